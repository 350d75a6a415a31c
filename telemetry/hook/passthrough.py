"""When the hook must pass straight through: torch.compile tracing and CUDA graph capture.

While dynamo traces, `torch.compiler.is_compiling()` is True (dynamo folds it to a constant, so the
record path is never traced into the graph). While a CUDA graph is being captured, reading the
allocator or the host would be recorded once at capture and never at replay, so nothing is
recorded. torch is looked up in sys.modules, never imported: a process without torch has
neither.

The capture check is on the hot path: `torch.cuda.is_current_stream_capturing()` asks the driver
(primary-context state, then the stream's capture status) on every call. PyTorch refuses to capture
on the default stream ("CUDA graphs must be captured on a non-default stream") and CUDA forbids
capturing the legacy default stream, so when the current stream is the default one (stream id 0, a
thread-local read) nothing can be capturing and the driver is not asked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

_is_compiling: Callable[[], bool] | None = None
_cuda: Any = None  # torch.cuda once bound
_is_capturing: Callable[[], bool] | None = None
_current_stream: Callable[[int], tuple[int, ...]] | None = None
_cuda_ready = False  # CUDA seen initialized (it never goes back, except in a forked child: reset())


def _bind() -> bool:
    global _is_compiling, _cuda, _is_capturing, _current_stream
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
    _current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
    _is_compiling = is_compiling
    return True


def passing_through() -> bool:
    """True while torch.compile traces or the current CUDA stream is capturing a graph."""
    global _cuda_ready
    if _is_compiling is None and not _bind():
        return False
    if _is_compiling():  # type: ignore[misc]  # bound just above
        return True
    if _is_capturing is None:
        return False
    if not _cuda_ready:
        # Only ask about streams once CUDA is initialized: never initialize it ourselves.
        if not _cuda.is_initialized():
            return False
        _cuda_ready = True
    if _current_stream is not None:
        try:
            if _current_stream(-1)[0] == 0:
                return False  # the default stream of the current device: cannot be capturing
        except Exception:  # an unexpected binding: keep only the full check from now on
            _disable_stream_shortcut()
    return _is_capturing()


def _disable_stream_shortcut() -> None:
    global _current_stream
    _current_stream = None


def reset() -> None:
    """Forget the bindings (tests, and after fork)."""
    global _is_compiling, _cuda, _is_capturing, _current_stream, _cuda_ready
    _is_compiling = _cuda = _is_capturing = _current_stream = None
    _cuda_ready = False
