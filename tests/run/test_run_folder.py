"""Issue 19, item 11: `memtel run` left a `memtel-<uid>/run-*` folder in the temp directory behind.

Before: the run directory stayed after every run until the next `memtel run` removed it. Now the program's own
Python process removes it at exit, when no child of it is left that could still use it (else it stays, and
the next run removes it as before). Real `memtel run`, with the temp directory (no XDG_RUNTIME_DIR).
"""

from __future__ import annotations

import os
import signal

from tests.run.conftest import memtel_run

TARGET = "memtel_run_target:logits"


def _temp_env(tmp_path, run_env) -> dict[str, str]:
    env = {k: v for k, v in run_env.items() if k != "XDG_RUNTIME_DIR"}
    (tmp_path / "tmp").mkdir(mode=0o700)
    env["TMPDIR"] = str(tmp_path / "tmp")
    return env


def test_memtel_run_leaves_a_run_folder_behind(tmp_path, run_env):
    env = _temp_env(tmp_path, run_env)
    done = memtel_run(["--targets", TARGET, "--port", "off"],
                      ["python", "-c", "import os; print(os.environ['MEMTEL_RUN_DIR'])"], env, timeout=120)
    assert done.returncode == 0, done.stderr
    run_dir = done.stdout.strip()
    assert run_dir.startswith(str(tmp_path / "tmp" / f"memtel-{os.geteuid()}" / "run-"))
    assert not os.path.exists(run_dir)
    assert os.listdir(tmp_path / "tmp" / f"memtel-{os.geteuid()}") == []


def test_a_run_folder_a_child_may_still_use_is_kept(tmp_path, run_env):
    env = _temp_env(tmp_path, run_env)
    program = ("import os, subprocess; child = subprocess.Popen(['sleep', '30'], stdout=subprocess.DEVNULL, "
               "stderr=subprocess.DEVNULL); "
               "print(os.environ['MEMTEL_RUN_DIR'], child.pid)")
    done = memtel_run(["--targets", TARGET, "--port", "off"], ["python", "-c", program], env, timeout=120)
    run_dir, child = done.stdout.split()
    try:
        assert done.returncode == 0, done.stderr
        assert os.path.isdir(run_dir)  # the child could still take a number from it
    finally:
        os.kill(int(child), signal.SIGKILL)
