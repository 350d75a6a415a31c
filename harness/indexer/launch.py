"""One logits launch of the sparse indexer, on a real CUDA device or on the allocator simulator.

`indexer_logits_launch` is the hook target `harness.indexer.launch:indexer_logits_launch` (preset
`lab-indexer`): the lab server and `memtel replay` call it through the module attribute, at call
time, once per launch, so an installed hook sees every launch. Keep it a plain module-level
function. torch is imported only when a CUDA backend is used.
"""

from __future__ import annotations

import math
from typing import Any

FLOAT32_BYTES = 4


def scaled_rows(rows: int, scale: float) -> int:
    """Rows of a launch at `scale` (the lab's --scale shrinks every launch's bytes; at least one row)."""
    return rows if scale == 1.0 else max(1, math.ceil(rows * scale))


def _is_simulator(backend: Any) -> bool:
    return hasattr(backend, "malloc") and hasattr(backend, "free") and hasattr(backend, "stats")


def indexer_logits_launch(backend: Any, rows: int, width: int, kv_len: int) -> Any:
    """Allocate one float32 logits launch ``[rows, width]`` and write its computed part.

    backend: a torch device (``"cuda"``, ``"cuda:1"``, ``torch.device``) for a real allocation, or
        a ``CachingAllocatorSim`` (anything with ``malloc``/``free``/``stats``) for a simulated one.
    rows: query rows in this launch (the chunk's tokens, or a row sub-chunk of them).
    width: allocated columns: the kv length (stock) or the fixed padded width.
    kv_len: computed columns, ``<= width``; on CUDA ``logits[:, :kv_len]`` is written so that its
        pages are really touched, the padding is left as allocated.

    Returns the logits: a ``torch.Tensor`` on CUDA, an ``int`` simulator handle otherwise. Release
    it with `release_logits(backend, logits)` (or drop the tensor's last reference).
    """
    if rows < 0 or width < 0 or not 0 <= kv_len <= width:
        raise ValueError(f"logits launch needs rows >= 0 and 0 <= kv_len <= width; got rows={rows}, width={width}, kv_len={kv_len}")
    if _is_simulator(backend):
        return backend.malloc(rows * width * FLOAT32_BYTES)
    import torch

    logits = torch.empty((rows, width), dtype=torch.float32, device=backend)
    if rows and kv_len:
        # A strided fill launches one kernel and allocates nothing: the op sequence stays the
        # logits allocations alone, as the simulator sees it.
        logits[:, :kv_len].fill_(1.0)
    return logits


def release_logits(backend: Any, logits: Any) -> None:
    """Free a launch's logits: `free` on the simulator; on CUDA the caller drops its references."""
    if _is_simulator(backend):
        backend.free(logits)
