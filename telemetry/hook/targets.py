"""Hook targets: parse "package.module:function" / "package.module:Class.method", patch, restore.

A target is patched where it lives (the module global or the class attribute), so every call
site that looks the name up at call time goes through the wrapper. A module that is not imported
yet is patched right after it is first imported: `ImportWatcher` is a `sys.meta_path` finder that
only answers for the watched module names (and their parent packages, to tell early that a module
does not exist) and otherwise stays out of the way.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from telemetry.errors import ConfigError
from telemetry.hook import presets

log = logging.getLogger("memtel.hook")

TARGET_FORM = '"package.module:function" or "package.module:Class.method"'
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

# Set on every memtel wrapper: the wrapped original, so a wrapper is never wrapped twice.
WRAPPED_ATTR = "__memtel_wrapped__"


@dataclass(frozen=True)
class Target:
    module: str     # "vllm.model_executor.layers.sparse_attn_indexer"
    qualname: str   # "fp8_fp4_mqa_logits" or "Class.method"

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"

    def __str__(self) -> str:
        return self.name


def parse_target(text: object) -> Target:
    """Parse one target; a malformed one raises ConfigError (a ValueError) that shows the expected form."""
    if not isinstance(text, str):
        raise ConfigError(f"hook target must be a string of the form {TARGET_FORM}, got {text!r}")
    module, sep, qualname = text.strip().partition(":")
    if not sep or not _DOTTED.match(module) or not _DOTTED.match(qualname) or qualname.count(".") > 1:
        raise ConfigError(f"malformed hook target {text!r}: expected {TARGET_FORM}")
    return Target(module, qualname)


def parse_targets(targets: str | Iterable[object]) -> list[Target]:
    """Targets and preset names (a comma-separated string or a list) -> targets; ConfigError if malformed."""
    items: list[object] = list(targets.split(",") if isinstance(targets, str) else targets)
    names = [item.strip() if isinstance(item, str) else item for item in items]
    names = [n for n in names if n != ""]
    if not names:
        raise ConfigError(f"no hook targets given: expected one or more of {TARGET_FORM} or a preset "
                          f"({', '.join(sorted(presets.PRESETS))})")
    texts: list[str] = []
    for name in names:
        if not isinstance(name, str):
            parse_target(name)  # raises: says what a target looks like
        elif ":" not in name and name not in presets.PRESETS:
            raise ConfigError(f"unknown hook target or preset {name!r}: expected {TARGET_FORM} or one of the "
                              f"presets {', '.join(sorted(presets.PRESETS))}")
        else:
            texts.append(name)
    return [parse_target(t) for t in presets.expand(texts)]


def unwrap(obj: Any) -> Any:
    """The original object behind any memtel wrappers."""
    while True:
        inner = getattr(obj, WRAPPED_ATTR, None)
        if inner is None:
            return obj
        obj = inner


class InstallError(Exception):
    """A target that cannot be installed (counted and logged by the session, never raised to the host);
    `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Patch:
    target: Target
    owner: Any        # the module or the class whose attribute was replaced
    attribute: str
    original: Any     # what the attribute held before (memtel wrappers unwrapped)
    wrapper: Any

    def restore(self) -> None:
        # Only put the original back if our wrapper is still there: a later patch by someone else wins.
        current = self.owner.__dict__.get(self.attribute) if isinstance(self.owner, type) else getattr(
            self.owner, self.attribute, None)
        if current is self.wrapper:
            setattr(self.owner, self.attribute, self.original)


def apply_patch(target: Target, module: Any,
                make_wrapper: Callable[[Callable[..., Any], Target], Callable[..., Any]]) -> Patch:
    """Replace the target's attribute in the (imported) module; InstallError if it is not there."""
    owner: Any = module
    parts = target.qualname.split(".")
    if len(parts) == 2:
        owner = getattr(module, parts[0], None)
        if not isinstance(owner, type):
            raise InstallError("attribute_not_found",
                               f"{target}: {target.module} has no class {parts[0]!r}")
    attribute = parts[-1]
    if isinstance(owner, type):
        if attribute not in owner.__dict__:
            # Patching a base class's method in a subclass would hook only this subclass: say so.
            raise InstallError("attribute_not_found",
                               f"{target}: {owner.__qualname__} does not define {attribute!r} itself")
        raw = owner.__dict__[attribute]
    else:
        if not hasattr(owner, attribute):
            raise InstallError("attribute_not_found", f"{target}: {target.module} has no attribute {attribute!r}")
        raw = getattr(owner, attribute)
    original = unwrap(raw)
    if isinstance(original, (staticmethod, classmethod)):
        wrapper: Any = type(original)(make_wrapper(original.__func__, target))
        setattr(wrapper, WRAPPED_ATTR, original)
    elif callable(original):
        wrapper = make_wrapper(original, target)
    else:
        raise InstallError("not_callable", f"{target}: {type(original).__name__} object is not callable")
    setattr(owner, attribute, wrapper)
    return Patch(target, owner, attribute, original, wrapper)


def module_exists(name: str) -> bool | None:
    """Whether `name` can be imported, found without importing anything.

    Walks down from the top-level package: each level is looked up only once its parent package
    is imported (finding a submodule of an unimported package would import the package). None:
    every level that can be checked now exists, the rest will be checked as parents get imported.
    """
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if prefix in sys.modules:
            continue
        try:
            found = importlib.util.find_spec(prefix) is not None
        except (ImportError, ValueError, AttributeError):
            found = False
        if not found:
            return False
        return True if depth == len(parts) else None
    return True


class _PatchingLoader:
    """Wraps a module's loader: runs the module, then lets the watcher patch it."""

    def __init__(self, loader: Any, watcher: ImportWatcher) -> None:
        self._loader = loader
        self._watcher = watcher

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        spec = getattr(module, "__spec__", None)
        # The module keeps its own loader: code that inspects __loader__ must not see this proxy.
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._watcher.module_loaded(module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class ImportWatcher:
    """A meta path finder that calls `on_loaded(name)` after a watched module is first imported.

    Parent packages of watched modules are watched too, so a module that does not exist is found
    out (and reported through `on_missing`) as soon as its parent is imported.
    """

    def __init__(self, on_loaded: Callable[[str], None], on_missing: Callable[[str], None]) -> None:
        self._on_loaded = on_loaded
        self._on_missing = on_missing
        self._modules: set[str] = set()     # modules with pending targets
        self._watched: set[str] = set()     # those and their parent packages
        self._lock = threading.RLock()
        self._local = threading.local()

    def watch(self, module: str) -> None:
        with self._lock:
            self._modules.add(module)
            self._rebuild()
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def unwatch(self, module: str) -> None:
        with self._lock:
            self._modules.discard(module)
            self._rebuild()
            if not self._modules:
                self.close()

    def close(self) -> None:
        with self._lock:
            self._modules.clear()
            self._watched.clear()
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass

    def _rebuild(self) -> None:
        watched: set[str] = set()
        for name in self._modules:
            parts = name.split(".")
            watched.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        self._watched = watched

    # importlib protocol
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self._watched or getattr(self._local, "busy", False):
            return None
        self._local.busy = True  # the other finders may import; do not answer for ourselves meanwhile
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self)  # type: ignore[assignment]  # a proxy: duck-typed
        return spec

    def module_loaded(self, name: str) -> None:
        prefix = name + "."
        with self._lock:
            pending = name in self._modules
            below = [m for m in self._modules if m.startswith(prefix)]
        if pending:
            self._on_loaded(name)
        # The package is now imported: a watched child that cannot be found will never load.
        for child in {prefix + m[len(prefix):].split(".")[0] for m in below}:
            if module_exists(child) is False:
                for module in below:
                    if module == child or module.startswith(child + "."):
                        self._on_missing(module)
