"""When the hook must pass straight through: torch.compile tracing and CUDA graph capture.

While dynamo traces, `torch.compiler.is_compiling()` is True (dynamo folds it to a constant, so the
record path is never traced into the graph). While a CUDA graph is being captured, reading the
allocator or the host would be recorded once at capture and never at replay, so nothing is
recorded. torch is looked up in sys.modules, never imported: a process without torch has
neither.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

_is_compiling: Optional[Callable[[], bool]] = None
_cuda = None  # torch.cuda once bound
_is_capturing: Optional[Callable[[], bool]] = None


def _bind() -> bool:
    global _is_compiling, _cuda, _is_capturing
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    if is_compiling is None:  # torch < 2.3: dynamo's own flag, if dynamo was ever imported
        dynamo = sys.modules.get("torch._dynamo")
        is_compiling = getattr(dynamo, "is_compiling", None)
    cuda = getattr(torch, "cuda", None)
    if is_compiling is None or cuda is None:
        return False  # torch is still being imported
    _cuda = cuda
    _is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    _is_compiling = is_compiling
    return True


def passing_through() -> bool:
    """True while torch.compile traces or the current CUDA stream is capturing a graph."""
    if _is_compiling is None and not _bind():
        return False
    if _is_compiling():
        return True
    # The capture check touches the current stream: only ask once CUDA is initialized (never init it).
    return _is_capturing is not None and _cuda.is_initialized() and _is_capturing()


def reset() -> None:
    """Forget the bindings (tests, and after fork)."""
    global _is_compiling, _cuda, _is_capturing
    _is_compiling = _cuda = _is_capturing = None
