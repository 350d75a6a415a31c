"""`memtel run`'s input, its exec, and its bootstrap (tests/run/conftest.py starts it as `python -m telemetry run`).

Bad input is one line and a non-zero exit before anything starts (no run directory, no program); the program
then is memtel run's process itself (exec): its pid, its signals and its exit status. The bootstrap keeps
the user's own sitecustomize, leaves sys.path as it was, and lets a Python without memtel run unhooked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import venv

import pytest

from tests.run.conftest import PROGRAMS, announcements, logs_by_pid, memtel_run, memtel_run_command
from tests.support.cli import call_main

TARGET = "memtel_run_target:logits"
BOOTSTRAP = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "telemetry", "run", "bootstrap")


SHELL_CASES = ("no command given: expected memtel run [--targets SPEC]", "command not found: no-such-command-memtel",
               f"command is not executable: {os.devnull}")


@pytest.mark.parametrize("options, command, env_extra, code, message", [
    (["--targets", TARGET], [], {}, 2, "no command given: expected memtel run [--targets SPEC]"),
    ([], ["true"], {}, 2, "no hook targets: give --targets SPEC or set MEMTEL_TARGETS"),
    (["--targets", "vllm-sparse-indexr"], ["true"], {}, 2, "--targets: unknown hook target or preset "
                                                            "'vllm-sparse-indexr'"),
    (["--targets", "a.b:c d"], ["true"], {}, 2, "--targets: malformed hook target 'a.b:c d'"),
    (["--targets", TARGET, "--port", "92OO"], ["true"], {}, 2, "--port='92OO' is not a port"),
    (["--targets", TARGET, "--port", "70000"], ["true"], {}, 2, "--port='70000' is not a port"),
    (["--targets", TARGET], ["true"], {"MEMTEL_PORT": "x"}, 2, "MEMTEL_PORT='x' is not a port"),
    (["--targets", TARGET, "--log-dir", "/tmp"], ["true"], {}, 2, "call-log directory /tmp is writable by group"),
    (["--targets", TARGET, "--unresolved-after", "-1"], ["true"], {}, 2, "--unresolved-after='-1' is not a delay"),
    (["--targets", TARGET], ["true"], {"MEMTEL_ENABLE": "0"}, 2, "MEMTEL_ENABLE='0' turns the hook off"),
    (["--targets", TARGET, "--bogus"], ["true"], {}, 2, "unrecognized arguments: --bogus"),
    (["--targets", TARGET], ["no-such-command-memtel"], {}, 127, "command not found: no-such-command-memtel"),
    (["--targets", TARGET], [os.devnull], {}, 126, f"command is not executable: {os.devnull}"),
])
def test_bad_input_is_one_line_and_nothing_starts(tmp_path, run_env, options, command, env_extra, code, message):
    """In this process through the CLI's entry function (an exec would raise instead of replacing it); the
    cases in SHELL_CASES through the console script too, for the exit status the shell sees."""
    done = call_main(["run", *options, "--", *command], env={**run_env, **env_extra})
    if message in SHELL_CASES:
        shell = memtel_run(options, command, {**run_env, **env_extra}, timeout=60)
        assert (shell.returncode, shell.stdout, shell.stderr) == (done.returncode, done.stdout, done.stderr)
    assert done.returncode == code
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("memtel run: error: ") and message in line, line
    runtime = tmp_path / "xdg"
    assert not (runtime / "memtel").exists() or not list((runtime / "memtel").iterdir())   # no run directory


def test_the_program_is_memtel_runs_process_with_its_exit_status(tmp_path, run_env):
    program = ("import os, sys; d = os.environ['MEMTEL_RUN_DIR']; "
               "print(os.getpid(), os.getppid(), d, oct(os.stat(d).st_mode & 0o777)); sys.exit(7)")
    done = memtel_run(["--targets", TARGET, "--port", "off"], ["python", "-c", program], run_env)
    assert done.returncode == 7
    # the run's directory is named after the program's pid (memtel run's, kept by exec), private while it ran,
    # and removed by the program's own exit (issue 19 item 11: no run-* folder left behind)
    pid, _, run_dir, mode = done.stdout.split()
    assert os.path.basename(run_dir).startswith(f"run-{pid}-") and mode == "0o700"
    assert os.path.dirname(run_dir) == str(tmp_path / "xdg" / "memtel") and not os.path.exists(run_dir)


def test_a_signal_sent_to_memtel_run_reaches_the_program(tmp_path, run_env):
    log_dir = tmp_path / "logs"
    program = ("import os, time, memtel_run_target\n"
               "memtel_run_target.logits(2, 3)\n"
               "print(os.getpid(), flush=True)\n"
               "time.sleep(60)\n")
    process = subprocess.Popen([*memtel_run_command("--targets", TARGET, "--port", "off", "--log-dir", str(log_dir)),
                                "--", "python", "-c", program], env=run_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    pid = int(process.stdout.readline())
    assert pid == process.pid
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM, stderr   # died of the signal, as without memtel
    (records,) = [rs for _, rs in logs_by_pid(log_dir).values()]
    assert [r["call"] for r in records] == [0]   # the hook flushed its log on the way (its SIGTERM handler chains)


def test_a_program_that_kills_itself_with_sigint_keeps_that_status(run_env):
    done = memtel_run(["--targets", TARGET, "--port", "off"],
                      ["python", "-c", "import os, signal; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                                       "os.kill(os.getpid(), signal.SIGINT); import time; time.sleep(30)"], run_env)
    assert done.returncode == -signal.SIGINT


def test_the_bootstrap_leaves_the_path_and_runs_the_users_own_sitecustomize(tmp_path, run_env):
    user = tmp_path / "user-site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    program = ("import os, sys, sitecustomize\n"
               "print(os.environ.get('USER_SITECUSTOMIZE'))\n"
               "print(sitecustomize.__file__)\n"
               "print(any('telemetry/run/bootstrap' in p for p in sys.path))\n"
               "print(os.environ['PYTHONPATH'])\n"
               "from telemetry.hook import active_handle\n"
               "print(active_handle().config.targets)\n")
    env = {**run_env, "PYTHONPATH": os.pathsep.join([str(user), str(PROGRAMS)])}
    done = memtel_run(["--targets", TARGET], ["python", "-c", program], env)
    assert done.returncode == 0, done.stderr
    ran, where, on_path, python_path, targets = done.stdout.splitlines()
    assert ran == "ran" and where == str(user / "sitecustomize.py") and on_path == "False"
    assert python_path == os.pathsep.join([BOOTSTRAP, str(user), str(PROGRAMS)])
    assert targets == f"('{TARGET}',)"
    # Nothing hooked anywhere: no exporter, no log, and at exit one warning that names the target.
    (line,) = done.stderr.splitlines()
    assert "1 of 1 hook targets not resolved at the exit of the run's first process" in line
    assert f"{TARGET} (its module was never imported)" in line


def test_a_python_without_memtel_runs_unhooked_and_says_so_once(tmp_path, run_env):
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)   # a venv of the base interpreter: no memtel in it
    done = memtel_run(["--targets", TARGET], [str(bare / "bin" / "python"), "-c", "import sys; sys.exit(5)"],
                      run_env)
    assert done.returncode == 5
    (line,) = done.stderr.splitlines()
    assert line.startswith("memtel run: no hook in pid ") and "cannot import memtel" in line


def test_the_hook_and_memtel_run_work_without_re2(tmp_path, run_env):
    # google-re2 is only for the daemon's kernel-log patterns; the device machine has none. Here an `re2`
    # that fails to import stands first on the path.
    blocked = tmp_path / "no-re2"
    (blocked / "re2").mkdir(parents=True)
    (blocked / "re2" / "__init__.py").write_text("raise ImportError('re2 is not installed here')\n")
    log_dir = tmp_path / "logs"
    program = ("import sys, memtel_run_target\n"
               "memtel_run_target.logits(1, 1)\n"
               "import telemetry.hook, telemetry.run.boot, telemetry.run.cli, telemetry.vllm_plugin\n"
               "print(sorted(m for m in sys.modules if m.split('.')[0] == 're2'))\n")
    env = {**run_env, "PYTHONPATH": os.pathsep.join([str(blocked), str(PROGRAMS)])}
    done = memtel_run(["--targets", TARGET, "--port", "off", "--log-dir", str(log_dir)], ["python", "-c", program],
                      env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert len(logs_by_pid(log_dir)) == 1


def test_with_the_vllm_plugin_too_the_hook_installs_once(tmp_path, run_env):
    # vLLM calls every `vllm.general_plugins` entry point in each of its processes; memtel's is installed here
    # (pyproject.toml). Under memtel run the plugin must step aside: one install, one announcement.
    program = ("from importlib.metadata import entry_points\n"
               "(plugin,) = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'memtel']\n"
               "plugin.load()()\n"
               "import memtel_run_target\n"
               "memtel_run_target.logits(1, 1)\n"
               "from telemetry.hook import active_handle\n"
               "print(active_handle().config.unresolved_at_first_call)\n")
    done = memtel_run(["--targets", TARGET, "--port", "off"], ["python", "-c", program], run_env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"   # memtel run's configuration, not the plugin's
    assert len(announcements(done.stderr)) == 1
    assert "already installed" not in done.stderr and "telemetry off" not in done.stderr
    # The same program without memtel run: the plugin installs the hook (the entry point is real).
    plain = subprocess.run([sys.executable, "-c", program], env={**run_env, "MEMTEL_TARGETS": TARGET,
                                                                 "MEMTEL_PORT": "off"},
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "False"


def test_stale_run_directories_are_removed_by_the_next_run(tmp_path, run_env):
    # A program that is not Python cannot remove its run directory at exit: it stays behind...
    done = memtel_run(["--targets", TARGET, "--port", "off"], ["sh", "-c", "true"], run_env)
    assert done.returncode == 0, done.stderr
    assert len(list((tmp_path / "xdg" / "memtel").iterdir())) == 1
    # ...until the next memtel run, whose Python program then removes its own at exit
    done = memtel_run(["--targets", TARGET, "--port", "off"], ["python", "-c", "pass"], run_env)
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "xdg" / "memtel").iterdir()) == []
