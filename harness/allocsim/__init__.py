"""The caching-allocator simulator: PyTorch's CUDA caching allocator, modelled rule for rule.

`CachingAllocatorSim` (simulator.py) is the allocator; `parse_alloc_conf` (config.py) reads
`PYTORCH_CUDA_ALLOC_CONF` strings; `DriverAddressSpace` (driver_va.py) models the CUDA driver's
cudaMalloc addresses; `ops` replays op files in the shared truth format.
"""

from .config import AllocatorConfig, AllocatorConfigError, parse_alloc_conf
from .driver_va import DriverAddressSpace
from .ops import OpFileError, load_op_file, replay_cases, replay_ops
from .simulator import CachingAllocatorSim, SimulatedOutOfMemoryError, allocation_size, round_size

__all__ = [
    "AllocatorConfig",
    "AllocatorConfigError",
    "CachingAllocatorSim",
    "DriverAddressSpace",
    "OpFileError",
    "SimulatedOutOfMemoryError",
    "allocation_size",
    "load_op_file",
    "parse_alloc_conf",
    "replay_cases",
    "replay_ops",
    "round_size",
]
