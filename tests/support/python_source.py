"""Reading Python source with `ast`, never importing it: what the preset checks need (tests/hook/test_presets*.py)."""

from __future__ import annotations

import ast

Function = ast.FunctionDef | ast.AsyncFunctionDef


def module_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level, conditional definitions (platform switches) included."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.If, ast.Try)):  # conditional definitions (platform switches)
            inner = [n for n in list(ast.walk(node))[1:] if isinstance(n, ast.stmt)]
            names.update(module_level_names(ast.Module(body=inner, type_ignores=[])))
    return names


def local_names(function: Function) -> set[str]:
    """Names bound inside the function (parameters, assignments, imports) - not global lookups."""
    args = function.args
    names = {a.arg for a in args.args + args.kwonlyargs + args.posonlyargs}
    names.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def calls_in(function: Function, name: str) -> list[ast.Call]:
    return [node for node in ast.walk(function)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name]


def functions(tree: ast.AST) -> list[Function]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def called_names(node: ast.AST) -> set[str]:
    """Names this code calls: `f(...)` gives f, `obj.method(...)` gives method."""
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            if isinstance(call.func, ast.Name):
                names.add(call.func.id)
            elif isinstance(call.func, ast.Attribute):
                names.add(call.func.attr)
    return names


def module_aliases(tree: ast.AST, module: str) -> set[str]:
    """Names that `import <module> [as alias]` or `from <parent> import <child> [as alias]` (parent.child being
    the module) bind to the module in this code (a module's top level or one function)."""
    parent, _, child = module.rpartition(".")
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name for alias in node.names if alias.name == module}
        elif isinstance(node, ast.ImportFrom) and parent and node.module == parent and node.level == 0:
            names |= {alias.asname or alias.name for alias in node.names if alias.name == child}
    return names


def attribute_reads(function: Function, aliases: set[str], name: str) -> list[ast.Attribute]:
    """`alias.name` read in the function, for an alias of the target's module."""
    return [node for node in ast.walk(function) if isinstance(node, ast.Attribute) and node.attr == name
            and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name) and node.value.id in aliases]


def name_reads(function: Function, name: str) -> list[ast.Name]:
    return [node for node in ast.walk(function)
            if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)]


def local_from_imports(function: Function, module: str, name: str) -> set[str]:
    """The local names `from <module> import <name> [as alias]` binds inside the function."""
    return {alias.asname or alias.name for node in ast.walk(function)
            if isinstance(node, ast.ImportFrom) and node.module == module and node.level == 0
            for alias in node.names if alias.name == name}
