import subprocess
import sys

from telemetry.cli import COMMANDS, main


def test_help_lists_every_subcommand(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_version_from_console_entry():
    result = subprocess.run([sys.executable, "-m", "telemetry", "--version"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.startswith("memtel ")


def test_daemon_help_does_not_import_torch():
    code = (
        "import sys; from telemetry.cli import main\n"
        "try:\n    main(['daemon', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'daemon imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_harness_command_without_the_harness_extra_says_what_to_install():
    # The core install (pip install memtel) has no httpx, matplotlib or rich: `memtel demo` must say so in one
    # line, not end in an import traceback. Here httpx is made unimportable in a fresh interpreter.
    code = "import sys; sys.modules['httpx'] = None\nfrom telemetry.cli import main\nsys.exit(main(['demo']))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "memtel demo: error: it needs the Python package 'httpx', which is not installed here: "
        "install it with pip install 'memtel[harness]'"]
