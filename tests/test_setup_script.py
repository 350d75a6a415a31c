"""Issue 19, item 7: scripts/lib/setup.sh fell back to `pkill -x prometheus`.

Before: when neither systemd nor the init script stopped the packaged Prometheus, the script killed every
process named prometheus on the machine. Now it stops only the pid in the package's pid file, and only if
that pid runs the package's binary. Real processes (a copy of `sleep` named prometheus) stand in for
the packaged server and for someone else's; systemctl and service are stubs that fail, as where neither
can stop anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _stop(tmp_path: Path, pidfile: Path, binary: Path) -> subprocess.CompletedProcess:
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for name in ("systemctl", "service"):
        (stubs / name).write_text("#!/bin/sh\nexit 1\n")
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}")
    return subprocess.run(["bash", "-c", f'source "{SCRIPTS / "lib" / "setup.sh"}" && '
                           f'stop_packaged_service prometheus "{pidfile}" "{binary}"'],
                          env=env, capture_output=True, text=True, timeout=30)


def _named_prometheus(folder: Path) -> Path:
    folder.mkdir()
    binary = folder / "prometheus"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", binary)
    return binary


def test_setup_sh_falls_back_to_pkill():
    for script in [*SCRIPTS.glob("*"), *SCRIPTS.glob("lib/*")]:
        if script.is_file():
            text = script.read_text(errors="replace")
            assert not re.search(r"\b(pkill|killall)\b", text), f"{script} kills processes by name"


def test_only_the_packaged_server_is_stopped(tmp_path):
    packaged_binary = _named_prometheus(tmp_path / "usr-bin")
    other_binary = _named_prometheus(tmp_path / "someone-elses")
    packaged = subprocess.Popen([packaged_binary, "60"])
    other = subprocess.Popen([other_binary, "60"])  # the same process name, not ours
    reaper = threading.Thread(target=packaged.wait, daemon=True)  # as init would: no zombie left to wait on
    reaper.start()
    try:
        pidfile = tmp_path / "prometheus.pid"
        pidfile.write_text(f"{packaged.pid}\n")
        result = _stop(tmp_path, pidfile, packaged_binary)
        assert result.returncode == 0, result.stderr
        reaper.join(10)
        assert packaged.returncode is not None
        assert other.poll() is None
        # A pid file naming a process that does not run the package's binary: left alone, and said so.
        pidfile.write_text(f"{other.pid}\n")
        result = _stop(tmp_path, pidfile, packaged_binary)
        assert result.returncode == 0 and "does not run" in result.stderr and other.poll() is None
        # No pid file at all: nothing is killed, one line says so.
        result = _stop(tmp_path, tmp_path / "missing.pid", packaged_binary)
        assert result.returncode == 0 and "could not stop" in result.stderr and other.poll() is None
    finally:
        for proc in (packaged, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
