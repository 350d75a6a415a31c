"""The caching-allocator simulator: PyTorch's CUDA caching allocator, modelled rule for rule.

`CachingAllocatorSim` (simulator.py) is the allocator; `parse_alloc_conf` (config.py) reads
`PYTORCH_CUDA_ALLOC_CONF` strings; `DriverAddressSpace` (driver_va.py) models the CUDA driver's
cudaMalloc addresses; `ops` replays op files in the shared truth format; snapshot.py starts a simulator
from a live process's `torch.cuda.memory_snapshot()`; trace.py and whatif.py replay a recorded
`_record_memory_history()` trace under other settings (`memtel whatif`).
"""

from .config import AllocatorConfig, AllocatorConfigError, parse_alloc_conf
from .driver_va import DriverAddressSpace
from .ops import OpFileError, load_op_file, replay_cases, replay_ops
from .simulator import CachingAllocatorSim, SimulatedOutOfMemoryError, allocation_size, round_size
from .snapshot import AllocatorState, SnapshotError, load_allocator_state, read_allocator_state, seeded_simulator

__all__ = [
    "AllocatorConfig",
    "AllocatorConfigError",
    "AllocatorState",
    "CachingAllocatorSim",
    "DriverAddressSpace",
    "OpFileError",
    "SimulatedOutOfMemoryError",
    "SnapshotError",
    "allocation_size",
    "load_allocator_state",
    "load_op_file",
    "parse_alloc_conf",
    "read_allocator_state",
    "replay_cases",
    "replay_ops",
    "round_size",
    "seeded_simulator",
]
