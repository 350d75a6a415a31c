import subprocess
import sys
from pathlib import Path

from telemetry.cli import all_commands, main
from telemetry.commands import Command, registered_commands


def test_help_lists_every_subcommand(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for name in all_commands():
        assert name in out
    assert {"ab", "lab", "demo"} <= set(all_commands())  # the harness's, through its entry points


def test_telemetry_names_no_harness_module():
    # The harness registers its commands (pyproject.toml, memtel.commands): the command line does not load them by
    # a string of their module's name, which would hide the dependency from the layer contract.
    text = Path("telemetry/cli.py").read_text()
    assert "harness." not in text


def test_a_broken_registered_command_is_left_out(tmp_path, monkeypatch, caplog):
    # A third party's entry point that fails to load, or names something that is not a Command, costs only itself.
    dist = tmp_path / "broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[memtel.commands]\nboom = not_a_module_anywhere:X\n"
                                           "notcmd = telemetry.commands:GROUP\nfine = harness.commands:AB\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    commands = registered_commands()
    assert "boom" not in commands and "notcmd" not in commands
    assert isinstance(commands["fine"], Command)
    assert "could not be loaded" in caplog.text and "is not a telemetry.commands.Command" in caplog.text


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
