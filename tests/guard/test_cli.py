"""`memtel guard`'s flags: bad ones are one line and exit 2, before anything listens."""

from __future__ import annotations

import subprocess
import sys

import pytest

from telemetry.cli import main


@pytest.mark.parametrize(("args", "words"), [
    (["--upstream", "ftp://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://127.0.0.1:9200"], "--upstream"),
    (["--upstream", "http://h:1/v1", "--listen", "127.0.0.1:0", "--hooks", "http://127.0.0.1:9200"], "base URL"),
    (["--upstream", "http://h:1", "--listen", "nohost", "--hooks", "http://127.0.0.1:9200"], "--listen"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1,,http://b:2"], "--hooks"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1,http://a:1"], "twice"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1", "--stale-s", "0"], "--stale-s"),
    # On an address of no interface: were the flag taken, the command would fail at once instead of serving.
    (["--upstream", "http://h:1", "--listen", "192.0.2.1:9", "--hooks", "http://a:1", "--reserve-mb", "nan"],
     "--reserve-mb"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1", "--when-blind", "maybe"],
     "--when-blind"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1", "--metrics-listen", "x"],
     "--metrics-listen"),
    (["--listen", "127.0.0.1:0", "--hooks", "http://a:1"], "--upstream"),
])
def test_bad_flags_are_one_line_and_exit_2(args, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        status = main(["guard", *args])
        raise SystemExit(status)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_core_install_is_enough():
    # The guard runs on serving boxes: no harness package, no httpx.
    code = ("import sys; import telemetry.guard.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('harness', 'httpx', 'torch', 'numpy')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_listen_address_in_use_is_one_line_and_exit_1(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status = main(["guard", "--upstream", "http://127.0.0.1:1", "--listen", f"127.0.0.1:{port}",
                       "--hooks", "http://127.0.0.1:2"])
    err = capsys.readouterr().err
    assert status == 1 and f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1


def test_the_command_serves_its_metrics_and_stops_cleanly_on_sigterm(tmp_path):
    import http.client
    import os
    import signal
    import time
    from pathlib import Path

    from tests.support.ports import free_port_block

    port = free_port_block(2)   # one block: two free_port() calls can return the same port
    metrics = port + 1
    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "guard.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "telemetry", "guard", "--upstream", "http://127.0.0.1:1",
                                    "--listen", f"127.0.0.1:{port}", "--hooks", "http://127.0.0.1:2",
                                    "--metrics-listen", f"127.0.0.1:{metrics}"], stdout=out, stderr=subprocess.STDOUT,
                                   cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        deadline, text = time.monotonic() + 30, ""
        while "memtel_guard_blind 1.0" not in text and time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", metrics, timeout=2)
                conn.request("GET", "/metrics")
                text = conn.getresponse().read().decode()
                conn.close()
            except OSError:
                time.sleep(0.1)
        assert "memtel_guard_blind 1.0" in text and "memtel_guard_hooks 1.0" in text  # the hook does not answer
        assert "memtel_guard_rejected_total{reason=\"would_not_fit\"} 0.0" in text
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "memtel guard stopped" in log.read_text()
