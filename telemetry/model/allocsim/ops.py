"""Op files: the allocator truth format, replayed on the simulator.

    {"config": "<PYTORCH_CUDA_ALLOC_CONF>",
     "cases": {"<name>": {"ops": [["malloc", id, size_bytes], ["free", id], ["empty_cache"], ...],
                          "after": [[reserved, allocated, num_device_alloc, num_device_free], ...]}}}

Each case runs on a fresh simulator (the truth starts every case after `empty_cache()` with
nothing live, and its rows are relative to the values before the case's first op). `after` is
optional here; it is the truth the simulator is compared with.

The cases of a file share one model of the driver's device addresses (driver_va.py), in file
order: the capture ran them one after another in one process, and `empty_cache()` does not reset
where the driver puts the next segment. Device addresses decide ties between equal-size free
blocks in different segments, so a case replayed alone can differ from the truth.

With `start` (an AllocatorState read from a memory snapshot) every case starts from that state
instead: its live blocks stay live, its free blocks are reused, and the rows are relative to the
snapshot's reserved and allocated bytes (event counts from 0).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from telemetry.errors import ConfigError
from telemetry.limits import MAX_OP_FILE_BYTES

from .config import AllocatorConfigError, parse_alloc_conf
from .driver_va import DriverAddressSpace
from .simulator import CachingAllocatorSim, SimulatedOutOfMemoryError

if TYPE_CHECKING:
    from .snapshot import AllocatorState

OP_NAMES = ("malloc", "free", "empty_cache")
MAX_MALLOC_BYTES = 2**44  # 16 TiB: a hundred times a device's memory, far inside the driver's address space
Row = list[int]


class OpFileError(ConfigError):
    """An op file that cannot be replayed; the message names the case, the op index and the problem."""


def _where(case: str, index: int | None = None) -> str:
    return f"case {case!r}" + ("" if index is None else f", op {index}")


def _check_op(case: str, index: int, op: Any) -> tuple[str, int, int]:
    if not isinstance(op, list) or not op or not isinstance(op[0], str):
        raise OpFileError(f"{_where(case, index)}: expected a list like [\"malloc\", id, size], got {op!r}")
    name = op[0]
    if name == "malloc":
        if len(op) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in op[1:]):
            raise OpFileError(f"{_where(case, index)}: malloc needs [\"malloc\", id, size_bytes] with integers, "
                              f"got {op!r}")
        if op[2] < 0:
            raise OpFileError(f"{_where(case, index)}: malloc size must be >= 0, got {op[2]}")
        if op[2] > MAX_MALLOC_BYTES:
            raise OpFileError(f"{_where(case, index)}: malloc size must be at most {MAX_MALLOC_BYTES:,} bytes "
                              f"(16 TiB), got {op[2]}")
        return name, op[1], op[2]
    if name == "free":
        if len(op) != 2 or not isinstance(op[1], int) or isinstance(op[1], bool):
            raise OpFileError(f"{_where(case, index)}: free needs [\"free\", id] with an integer id, got {op!r}")
        return name, op[1], 0
    if name == "empty_cache":
        if len(op) != 1:
            raise OpFileError(f"{_where(case, index)}: empty_cache takes no arguments, got {op!r}")
        return name, 0, 0
    raise OpFileError(f"{_where(case, index)}: unknown op {name!r} (expected one of {', '.join(OP_NAMES)})")


class RecordedAddresses:
    """cudaMalloc addresses taken from a real run: the data pointer each malloc op returned.

    A new segment's first block starts at the segment's base, so the pointer of the malloc that
    created a segment is that segment's address. `telemetry.model.capture.truth --addresses` records them.
    """

    def __init__(self, pointers: list[int]) -> None:
        self._pointers = pointers
        self.current = 0  # index of the malloc being replayed

    def alloc(self, size: int) -> int:
        return self._pointers[self.current]

    def release(self, addr: int, size: int) -> None:
        pass


def replay_ops(
    ops: list[Any],
    config: str = "",
    *,
    capacity_bytes: int | None = None,
    case: str = "ops",
    addresses: list[int] | None = None,
    address_space: DriverAddressSpace | None = None,
    start: AllocatorState | None = None,
) -> list[Row]:
    """Run `ops` on a fresh simulator; one `[reserved, allocated, device_alloc, device_free]` row per op.

    `addresses`: the device pointer each malloc returned in a real run (see RecordedAddresses).
    `address_space`: the driver's addresses, shared with the cases run before this one in the same
    process (default: a process that just started); the case's segments go back to it at the end,
    as the next case's `empty_cache()` does.
    `start`: begin from a snapshot's allocator state (rows relative to its counters).
    """
    if not isinstance(ops, list):
        raise OpFileError(f"{_where(case)}: 'ops' must be a list, got {type(ops).__name__}")
    recorded = RecordedAddresses(addresses) if addresses is not None else None
    mallocs = 0
    base_reserved = base_allocated = 0
    try:
        if start is not None:
            from .snapshot import SnapshotError, seeded_simulator

            try:
                sim = seeded_simulator(start, config, capacity_bytes=capacity_bytes)
            except SnapshotError as exc:
                raise OpFileError(f"{_where(case)}: {exc}") from None
            base_reserved, base_allocated = sim.reserved_bytes, sim.allocated_bytes
        else:
            driver = recorded if recorded is not None else address_space
            sim = CachingAllocatorSim(config, capacity_bytes=capacity_bytes, address_space=driver)
    except AllocatorConfigError as exc:
        raise OpFileError(f"{_where(case)}: {exc}") from None
    live: dict[int, int] = {}
    failed: set[int] = set()  # ids whose malloc ran out of memory: their free is a no-op, as in torch
    rows: list[Row] = []
    append = rows.append
    for index, op in enumerate(ops):
        name, ident, size = _check_op(case, index, op)
        if name == "malloc":
            if ident in live:
                raise OpFileError(f"{_where(case, index)}: malloc of id {ident}, which is still live (not freed)")
            failed.discard(ident)
            if recorded is not None:
                recorded.current = mallocs
            mallocs += 1
            try:
                live[ident] = sim.malloc(size)
            except SimulatedOutOfMemoryError:
                failed.add(ident)  # torch raised OutOfMemoryError: the row is recorded, the id is not live
        elif name == "free":
            handle = live.pop(ident, None)
            if handle is None and ident in failed:
                failed.discard(ident)
            elif handle is None:
                raise OpFileError(f"{_where(case, index)}: free of unknown id {ident} "
                                  "(never allocated or already freed)")
            else:
                sim.free(handle)
        else:
            sim.empty_cache()
        append([sim.reserved_bytes - base_reserved, sim.allocated_bytes - base_allocated, sim.num_device_alloc,
                sim.num_device_free])
    if address_space is not None and recorded is None and start is None:
        for handle in list(live.values()):
            sim.free(handle)
        sim.empty_cache()
    return rows


def validate_document(data: Any, source: str = "op file") -> tuple[str, dict[str, list[Any]]]:
    """Check the document's shape; returns (config string, {case name: ops})."""
    if not isinstance(data, Mapping):
        raise OpFileError(f"{source}: expected a JSON object with 'config' and 'cases'")
    config = data.get("config", "")
    if config is None:
        config = ""
    if not isinstance(config, str):
        raise OpFileError(f"{source}: 'config' must be a PYTORCH_CUDA_ALLOC_CONF string, got {config!r}")
    cases = data.get("cases")
    if not isinstance(cases, Mapping) or not cases:
        raise OpFileError(f"{source}: 'cases' must be a non-empty object of name -> {{\"ops\": [...]}}")
    out: dict[str, list[Any]] = {}
    for name, case in cases.items():
        if not isinstance(case, Mapping) or "ops" not in case:
            raise OpFileError(f"{source}: case {name!r} must be an object with an 'ops' list")
        out[str(name)] = case["ops"]
    try:
        parse_alloc_conf(config)
    except AllocatorConfigError as exc:
        raise OpFileError(f"{source}: {exc}") from None
    return config, out


def load_op_file(path: str | Path, max_bytes: int = MAX_OP_FILE_BYTES) -> Any:
    """The JSON document of an op file: a regular file of at most `max_bytes` (refused before reading)."""
    from telemetry.safefs import FileTooLargeError, read_capped

    path = Path(path)
    try:
        data = read_capped(path, max_bytes, follow_symlinks=True)
    except FileTooLargeError:
        raise OpFileError(f"{path}: larger than {max_bytes:,} bytes; expected an op file (JSON)") from None
    except OSError as exc:
        raise OpFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_op_json(data, str(path))


def parse_op_json(data: bytes, source: str) -> Any:
    """An op document from JSON bytes; OpFileError (one line) for anything that is not plain JSON."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise OpFileError(f"{source}: not UTF-8 text (byte {exc.start}); expected an op file (JSON)") from None
    except json.JSONDecodeError as exc:
        raise OpFileError(f"{source}: not valid JSON: {exc}") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise OpFileError(f"{source}: a value cannot be read: {str(exc)[:100]}") from None
    except RecursionError:
        raise OpFileError(f"{source}: nested too deeply to be an op file") from None


def replay_cases(data: Any, *, capacity_bytes: int | None = None, source: str = "op file",
                 start: AllocatorState | None = None) -> dict[str, list[Row]]:
    """Replay every case of an op document in order, as one process; {case name: rows}.

    `start`: every case begins from this snapshot state (rows relative to its counters).
    """
    config, cases = validate_document(data, source)
    if start is not None:
        return {name: replay_ops(ops, config, capacity_bytes=capacity_bytes, case=name, start=start)
                for name, ops in cases.items()}
    driver = DriverAddressSpace()
    return {
        name: replay_ops(ops, config, capacity_bytes=capacity_bytes, case=name, address_space=driver)
        for name, ops in cases.items()
    }


def first_mismatch(expected: list[Row], got: list[Row]) -> tuple[int, Row | None, Row | None] | None:
    """The first op index where two row lists differ (or None when they agree)."""
    for index in range(max(len(expected), len(got))):
        want = expected[index] if index < len(expected) else None
        have = got[index] if index < len(got) else None
        if want != have:
            return index, want, have
    return None
