"""Issue 19, item 8: `memtel run` could not hook a module that sits beside the script, nor one run by `python -m`.

Before: the target was judged at interpreter start, before the script's folder (or, for `python -m`, the
working directory) was on sys.path: `hook target not installed (module_not_found)`, then `(no such
module)` at exit, although the program imported it. Now a target resolves when its module is imported,
however it got onto sys.path, and "not installed (module_not_found)" comes only for a module that was
never imported by the process's exit. Real `memtel run`, CPU only.
"""

from __future__ import annotations

from pathlib import Path

from tests.run.conftest import announcements, logs_by_pid, memtel_run

KERNEL = "def launch_logits(x):\n    return x * 2\n"


def _check(done, log_dir: Path, target: str, calls: int) -> str:
    assert done.returncode == 0, done.stderr
    assert "module_not_found" not in done.stderr and "no such module" not in done.stderr, done.stderr
    (line,) = announcements(done.stderr).values()
    assert f"hooked: {target};" in line and "unresolved: none;" in line, line
    ((_, records),) = logs_by_pid(log_dir).values()
    assert [r["site"] for r in records] == [target] * calls
    return line


def test_memtel_run_cannot_hook_a_module_beside_the_script(tmp_path, run_env):
    app = tmp_path / "app"
    app.mkdir()
    (app / "mykern.py").write_text(KERNEL)
    (app / "main.py").write_text("import mykern\n\nfor i in range(3):\n    mykern.launch_logits(i)\n")
    done = memtel_run(["--targets", "mykern:launch_logits", "--port", "off", "--log-dir", str(tmp_path / "logs")],
                      ["python", str(app / "main.py")], run_env, timeout=120, cwd=tmp_path)
    _check(done, tmp_path / "logs", "mykern:launch_logits", 3)


def test_python_dash_m_package_is_hooked(tmp_path, run_env):
    package = tmp_path / "proj" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "kern.py").write_text(KERNEL)
    (package / "__main__.py").write_text("from mypkg import kern\n\nkern.launch_logits(1)\nkern.launch_logits(2)\n")
    done = memtel_run(["--targets", "mypkg.kern:launch_logits", "--port", "off", "--log-dir", str(tmp_path / "logs")],
                      ["python", "-m", "mypkg"], run_env, timeout=120, cwd=tmp_path / "proj")
    _check(done, tmp_path / "logs", "mypkg.kern:launch_logits", 2)


def test_a_module_never_imported_by_exit_is_said_once_at_exit(tmp_path, run_env):
    app = tmp_path / "app"
    app.mkdir()
    (app / "mykern.py").write_text(KERNEL)
    (app / "main.py").write_text("import mykern\n\nmykern.launch_logits(1)\n")
    targets = "mykern:launch_logits,memtel_nowhere_module:f"
    done = memtel_run(["--targets", targets, "--port", "off", "--log-dir", str(tmp_path / "logs")],
                      ["python", str(app / "main.py")], run_env, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    (missing,) = [i for i, line in enumerate(lines) if "hook target not installed (module_not_found)" in line]
    assert "memtel_nowhere_module:f" in lines[missing] and "by the exit of pid" in lines[missing]
    (announced,) = [i for i, line in enumerate(lines) if "memtel hook on in pid " in line]
    assert announced < missing  # said at exit, not at start
    assert "hooked: mykern:launch_logits;" in lines[announced]
