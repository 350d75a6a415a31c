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
