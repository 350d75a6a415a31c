"""One logits launch of the sparse indexer, on a real CUDA device or on the allocator simulator.

`indexer_logits_launch` is the hook target `telemetry.model.indexer.launch:indexer_logits_launch` (preset
`lab-indexer`): the launch loop's backends (telemetry/model/indexer/backends.py) call it through the module
attribute, at call time, once per launch, so an installed hook sees every launch. Keep it a plain
module-level function. torch is imported only when a CUDA device is used.
"""

from __future__ import annotations

from typing import Any

from telemetry.model.indexer.shape import FLOAT32_BYTES


def _is_simulator(device: Any) -> bool:
    return hasattr(device, "malloc") and hasattr(device, "free") and hasattr(device, "stats")


def indexer_logits_launch(device: Any, rows: int, width: int, kv_len: int) -> Any:
    """Allocate one float32 logits launch ``[rows, width]`` and write its computed part.

    device: a torch device (``"cuda"``, ``"cuda:1"``, ``torch.device``) for a real allocation, or
        a ``CachingAllocatorSim`` (anything with ``malloc``/``free``/``stats``) standing for one.
    rows: query rows in this launch (the chunk's tokens, or a row sub-chunk of them).
    width: allocated columns: the kv length (stock mode) or the padded width (fixed mode).
    kv_len: computed columns, ``<= width``; on CUDA ``logits[:, :kv_len]`` is written so that its
        pages are really touched, the padding is left as allocated.

    Returns the logits: a ``torch.Tensor`` on CUDA (dropping its last reference frees it), an ``int``
    simulator handle otherwise (``device.free(handle)`` frees it).
    """
    if rows < 0 or width < 0 or not 0 <= kv_len <= width:
        raise ValueError(f"logits launch needs rows >= 0 and 0 <= kv_len <= width; got rows={rows}, width={width}, "
                         f"kv_len={kv_len}")
    if _is_simulator(device):
        return device.malloc(rows * width * FLOAT32_BYTES)
    import torch

    logits = torch.empty((rows, width), dtype=torch.float32, device=device)
    if rows and kv_len:
        # A strided fill launches one kernel and allocates nothing: the op sequence stays the
        # logits allocations alone, as the simulator sees it.
        logits[:, :kv_len].fill_(1.0)
    return logits

