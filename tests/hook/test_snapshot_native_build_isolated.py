"""The native reader's background build runs isolated: a `telemetry/` package planted in the engine's working
directory is never imported by it (issue 27: without `-I` and its own working directory, `python -c` put the
working directory first on its path and ran the planted package as the serving user)."""

from __future__ import annotations

import os
import sys
import types

from telemetry.hook.forecast.snapshot_native import build
from telemetry.hook.forecast.snapshot_native.reader import NativeSnapshots


def test_a_package_planted_in_the_working_directory_is_not_run_by_the_build(tmp_path, monkeypatch):
    torch = types.SimpleNamespace(__version__="9.9.9+test", version=types.SimpleNamespace(cuda="13.0",
                                                                                        git_version="abc"))
    monkeypatch.setitem(sys.modules, "torch", torch)
    marker = tmp_path / "planted-ran"
    engine_cwd = tmp_path / "engine"
    (engine_cwd / "telemetry").mkdir(parents=True)
    (engine_cwd / "telemetry" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(engine_cwd)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": os.environ.get("PATH", "")}
    directory = build.build_directory(torch, env)
    build.private_directory(directory)
    # A failure written down before: the real build.main reads it and exits 1 at once (no compiler is started).
    (directory / build.FAILED).write_text("no compiler\n")
    reader = NativeSnapshots(env)
    reader.directory = directory
    reader._spawn(directory)   # the command and working directory the hook uses
    assert reader._build is not None
    code = reader._build.wait(30)
    log = (directory / build.LOG).read_text()
    assert not marker.exists(), f"the planted package ran in the build (log: {log!r})"
    assert code == 1 and log == "", log   # memtel's own build.main ran: it found failed.txt and gave up quietly
