import ast
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


def test_every_command_is_one_module_of_one_pattern():
    # telemetry's commands and the harness's alike: a Command whose module is its folder's cli.py (NAME_cli.py beside
    # the folder's own) and defines configure(parser) and run(args).
    for name, command in all_commands().items():
        path = Path(*command.module.split(".")).with_suffix(".py")
        assert path.name in ("cli.py", f"{name}_cli.py"), (name, command.module)
        defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
        assert {"configure", "run"} <= defined, (name, command.module)


def _imported(path: Path, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:  # a relative import: from the file's package up
        package = list(path.with_suffix("").parts[:-1])
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    return {base} | {f"{base}.{alias.name}" for alias in node.names}


def test_no_command_is_another_commands_library():
    # What several commands share lives below them (telemetry/command_helpers.py, the libraries beside each command):
    # only the command line imports a command's module (tests may).
    commands = {command.module: name for name, command in all_commands().items()}
    found = []
    for path in [p for root in ("telemetry", "harness", "benchmarks") for p in sorted(Path(root).rglob("*.py"))]:
        text = path.read_text()
        if "cli" not in text:  # every command's module is named cli or NAME_cli
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"{path}: {module}" for module in _imported(path, node) & commands.keys()]
    assert found == []


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
