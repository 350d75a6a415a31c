"""telemetry/hook_env.py: the hook's environment variables named once, and the hook's port range in the port table.

Every other module sets or reads a hook variable by its name in telemetry.hook_env (hook_env.TARGETS), and says
the hook's ports through telemetry/scrape/ports.py (HOOK_PORT_RANGE), so renaming one is one edit. The scan reads
every string a module of telemetry/, harness/ and benchmarks/ writes (an f-string's text parts too); docstrings are
prose, like docs/, and are not scanned.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from telemetry import hook_env
from telemetry.scrape.ports import HOOK_PORT_RANGE, hook_ports

ROOT = Path(__file__).resolve().parents[1]
THE_ONE_PLACE = {ROOT / "telemetry" / "hook_env.py", ROOT / "telemetry" / "scrape" / "ports.py"}
_VARIABLE = re.compile(r"\bMEMTEL_[A-Z0-9_]*")


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _typed(roots: tuple[Path, ...], skip: set[Path]) -> list[str]:
    """`path:line types NAME` for every hook variable's name (or the forecast's prefix) and the hook's port range
    in a string outside docstrings."""
    names = set(hook_env.HOOK_VARIABLES) | {hook_env.FORECAST_PREFIX}
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path in skip:
                continue
            text = path.read_text(encoding="utf-8")
            if "MEMTEL_" not in text and HOOK_PORT_RANGE not in text:
                continue   # nothing to find: not parsed (the scan stays cheap)
            tree = ast.parse(text, str(path))
            prose = _docstrings(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in prose:
                    continue
                typed = sorted({m for m in _VARIABLE.findall(node.value) if m in names})
                if HOOK_PORT_RANGE in node.value:
                    typed.append(HOOK_PORT_RANGE)
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found += [f"{where}:{node.lineno} types {name}" for name in typed]
    return found


def test_no_module_but_the_one_place_types_a_hook_variable_or_the_hook_port_range() -> None:
    found = _typed((ROOT / "telemetry", ROOT / "harness", ROOT / "benchmarks"), THE_ONE_PLACE)
    assert not found, ("a hook variable is named through telemetry.hook_env (hook_env.TARGETS) and the hook's port "
                       "range through telemetry.scrape.ports.HOOK_PORT_RANGE; these type them:\n" + "\n".join(found))


def test_a_module_typing_a_hook_variable_is_caught(tmp_path: Path) -> None:
    """The check itself: a key, a help text's f-string part and the port range are caught; a docstring, a
    LiteLLM variable and a name built from hook_env are not."""
    (tmp_path / "tool.py").write_text('''"""Reads MEMTEL_TARGETS (prose)."""
import os
from telemetry import hook_env
def go(env):
    """MEMTEL_LOG_DIR here is prose too."""
    env[hook_env.TARGETS] = os.environ.get("MEMTEL_LITELLM_HOLD_S", "")
    return env.get("MEMTEL_LOG_DIR"), f"default: MEMTEL_PORT ({env})", "no hook on ports 9200-9207"
''')
    assert sorted(line.partition(" ")[2] for line in _typed((tmp_path,), set())) == [
        f"types {HOOK_PORT_RANGE}", "types MEMTEL_LOG_DIR", "types MEMTEL_PORT"]


def test_the_port_range_is_the_hook_ports_of_a_node() -> None:
    ports = hook_ports()
    assert HOOK_PORT_RANGE == f"{ports[0]}-{ports[-1]}" == "9200-9207"


def test_every_hook_variable_is_named_once_and_is_a_memtel_variable() -> None:
    assert len(set(hook_env.HOOK_VARIABLES)) == len(hook_env.HOOK_VARIABLES)
    assert all(_VARIABLE.fullmatch(name) for name in hook_env.HOOK_VARIABLES)
    public = {name for name in hook_env.__all__ if name not in ("HOOK_VARIABLES", "FORECAST_PREFIX")}
    assert {getattr(hook_env, name) for name in public} == set(hook_env.HOOK_VARIABLES)


def test_every_hook_variable_is_documented() -> None:
    docs = "\n".join(page.read_text(encoding="utf-8") for page in sorted((ROOT / "docs").glob("*.md")))
    missing = [name for name in hook_env.HOOK_VARIABLES if f"`{name}" not in docs]
    assert not missing, f"hook variables no page of docs/ names (in backticks): {', '.join(missing)}"
