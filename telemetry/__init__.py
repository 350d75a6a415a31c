"""memtel telemetry: the in-process allocator hook and the node daemon.

Importing this package is cheap and never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable

    from telemetry.hook import HookHandle


__all__ = ["__version__", "install"]


def install(targets: str | Iterable[str], **options: Any) -> HookHandle:
    """Hook ``targets`` ("package.module:function", "package.module:Class.method" or preset names).

    ``options`` are the fields of ``telemetry.hook.HookConfig`` (port, addr, log_dir, record_shape, ...) and
    ``registry``. Returns the process's handle; its ``uninstall()`` restores the original objects. See
    docs/hook.md.
    """
    from telemetry.hook import install as _install

    return _install(targets, **options)


def __getattr__(name: str) -> Any:
    """`telemetry.__version__`, read from telemetry/version.py when asked: importing the package loads no module
    of it (vLLM's plugin entry imports only telemetry and telemetry.vllm_plugin)."""
    if name == "__version__":
        from telemetry.version import __version__

        return __version__
    raise AttributeError(f"module 'telemetry' has no attribute {name!r}")
