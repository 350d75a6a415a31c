"""The simulator against real allocator statistics: every row of every op of every case, exactly.

Truth files: tests/fixtures/allocator-truth/ (captured on an H200 with torch 2.11 by
telemetry/model/capture/truth.py and `memtel replay --record`) and the shared sample in
../shared/data/allocator-truth/ next to the clone. A file's cases are replayed in file order through
one model of the driver's device addresses, as the capture ran them in one process. The
`*.addresses.json` sidecars hold every malloc's real device pointer: they check the address model
itself, and replaying with them separates the allocator's rules from the driver's choices.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from telemetry.model.allocsim import CachingAllocatorSim, SimulatedOutOfMemoryError
from telemetry.model.allocsim.driver_va import ARENA_TOP, CONTEXT_SIZE, DriverAddressSpace
from telemetry.model.allocsim.ops import first_mismatch, replay_cases, replay_ops

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "allocator-truth"
SHARED = REPO.parent / "shared" / "data" / "allocator-truth"


def _truth_files() -> list[Path]:
    files = sorted(p for p in FIXTURES.glob("*.json") if not p.name.endswith(".addresses.json"))
    if SHARED.is_dir():
        files += sorted(SHARED.glob("*.json"))
    return files


def _cases():
    for path in _truth_files():
        doc = json.loads(path.read_text())
        for name in doc["cases"]:
            yield pytest.param(path, name, id=f"{path.stem}::{name}")


def _cases_with_addresses():
    for sidecar in sorted(FIXTURES.glob("*.addresses.json")):
        truth = sidecar.with_name(sidecar.name.replace(".addresses.json", ".json"))
        for name in json.loads(sidecar.read_text()):
            yield pytest.param(truth, sidecar, name, id=f"{truth.stem}::{name}")


_DOCS: dict[Path, dict] = {}
_REPLAYED: dict[Path, dict] = {}


def _doc(path: Path) -> dict:
    if path not in _DOCS:
        _DOCS[path] = json.loads(path.read_text())
    return _DOCS[path]


def _replayed(path: Path) -> dict:
    # A file's cases in file order through one driver-address model: the capture ran them one
    # after another in one process, which is what decides the device addresses.
    if path not in _REPLAYED:
        _REPLAYED[path] = replay_cases(_doc(path), source=path.name)
    return _REPLAYED[path]


def test_fixtures_cover_every_config_the_issue_names():
    configs = {_doc(p)["config"] for p in _truth_files() if p.parent == FIXTURES}
    for wanted in ("", "expandable_segments:True", "max_split_size_mb:256", "roundup_power2_divisions:4"):
        assert wanted in configs
    assert any("," in c for c in configs), "no combined config captured"


def test_shared_sample_is_present():
    # CI (.ci/run) always has ../shared beside its clone and requires it; a clone elsewhere may not.
    if not SHARED.is_dir() and not os.environ.get("MEMTEL_REQUIRE_SHARED"):
        pytest.skip(f"no shared allocator truth at {SHARED} (a clone outside the project folder); "
                    "set MEMTEL_REQUIRE_SHARED=1 to make this a failure")
    assert SHARED.is_dir(), f"shared allocator truth not found at {SHARED}"
    assert list(SHARED.glob("*.json"))


@pytest.mark.parametrize("path, case", list(_cases()))
def test_simulator_agrees_with_the_real_allocator(path: Path, case: str):
    doc = _doc(path)
    truth = doc["cases"][case]
    got = _replayed(path)[case]
    mismatch = first_mismatch(truth["after"], got)
    if mismatch is not None:
        index, want, have = mismatch
        pytest.fail(
            f"{path.name} [{doc['config']!r}] case {case}: op {index} {truth['ops'][index]}: "
            f"real [reserved, allocated, device_alloc, device_free] = {want}, simulator = {have}"
        )


@pytest.mark.parametrize("path, sidecar, case", list(_cases_with_addresses()))
def test_simulator_agrees_given_the_real_device_addresses(path: Path, sidecar: Path, case: str):
    doc = _doc(path)
    truth = doc["cases"][case]
    addresses = json.loads(sidecar.read_text())[case]
    got = replay_ops(truth["ops"], doc["config"], case=case, addresses=addresses)
    mismatch = first_mismatch(truth["after"], got)
    assert mismatch is None, f"{path.name} case {case}: op {mismatch[0]}: real {mismatch[1]}, simulator {mismatch[2]}"


def test_every_config_has_an_address_sidecar():
    truth = {p.stem for p in _truth_files() if p.parent == FIXTURES and p.name.startswith("h200-")}
    sidecars = {p.name.replace(".addresses.json", "") for p in FIXTURES.glob("*.addresses.json")}
    assert truth == sidecars


class _LoggedDriver(DriverAddressSpace):
    last: int | None = None

    def alloc(self, size: int) -> int:
        self.last = super().alloc(size)
        return self.last


def _segment_bases(path: Path) -> list[tuple[str, int, int, int]]:
    """(case, op index, real base, model base) of every cudaMalloc, the file replayed in order."""
    doc = _doc(path)
    pointers = json.loads(path.with_name(path.stem + ".addresses.json").read_text())
    driver = _LoggedDriver()
    out: list[tuple[str, int, int, int]] = []
    for name, case in doc["cases"].items():
        sim = CachingAllocatorSim(doc["config"], address_space=driver)
        live: dict[int, int] = {}
        mallocs = 0
        for index, op in enumerate(case["ops"]):
            if op[0] == "malloc":
                before, driver.last = sim.num_device_alloc, None
                try:
                    live[op[1]] = sim.malloc(op[2])
                except SimulatedOutOfMemoryError:
                    pass
                if sim.num_device_alloc > before and driver.last is not None:
                    # A new segment's first block starts at the segment's base.
                    out.append((name, index, pointers[name][mallocs], driver.last))
                mallocs += 1
            elif op[0] == "free":
                if op[1] in live:
                    sim.free(live.pop(op[1]))
            else:
                sim.empty_cache()
        for handle in live.values():
            sim.free(handle)
        sim.empty_cache()
    return out


_CUDAMALLOC_FILES = [
    pytest.param(p, id=p.stem)
    for p in sorted(FIXTURES.glob("h200-*.json"))
    if not p.name.endswith(".addresses.json") and "expandable" not in p.name  # no cudaMalloc there
]


@pytest.mark.parametrize("path", _CUDAMALLOC_FILES)
def test_driver_model_orders_every_real_segment_base(path: Path):
    bases = _segment_bases(path)
    assert len(bases) > 150
    # Same order: sorted by the model's address, the real addresses never go down, and one model
    # address always stands for one real address.
    pairs = sorted({(model, real) for _, _, real, model in bases})
    assert len({model for model, _ in pairs}) == len(pairs), "one model address, several real ones"
    reals = [real for _, real in pairs]
    assert reals == sorted(reals), f"{path.name}: segment bases in a different order than the model's"
    # And the same layout: below the CUDA context, every base is the model's plus one constant (ASLR).
    below = {real - model for _, _, real, model in bases if model < ARENA_TOP - CONTEXT_SIZE}
    assert len(below) == 1, f"{path.name}: {len(below)} different offsets between real and model bases"


def test_fixtures_hold_address_sensitive_cases():
    # A mirror image of the driver's addresses (same segments, opposite order) changes the outcome
    # of ties: if the fixtures had none, the address model would be untested by the counters.
    class Mirrored(DriverAddressSpace):
        def alloc(self, size: int) -> int:
            return ARENA_TOP - super().alloc(size) - size + ARENA_TOP

        def release(self, addr: int, size: int) -> None:
            super().release(2 * ARENA_TOP - addr - size, size)

    differing = []
    for path in _truth_files():
        doc = _doc(path)
        for name, case in doc["cases"].items():
            rows = replay_ops(case["ops"], doc["config"], case=name, address_space=Mirrored())
            if first_mismatch(case["after"], rows) is not None:
                differing.append((path.stem, name))
    assert len(differing) >= 10, differing


def test_the_memory_fraction_capture_really_ran_out_of_memory():
    # The fraction config exercises the OOM path (free cached, retry) and garbage collection.
    from telemetry.model.allocsim import CachingAllocatorSim

    path = FIXTURES / "h200-torch2.11-per-process-memory-fraction-0.05-garbage-collection-threshold-0.6.json"
    doc = _doc(path)
    ooms = 0
    for case in doc["cases"].values():
        sim = CachingAllocatorSim(doc["config"])
        live = {}
        for op in case["ops"]:
            if op[0] == "malloc":
                try:
                    live[op[1]] = sim.malloc(op[2])
                except MemoryError:
                    pass
            elif op[0] == "free" and op[1] in live:
                sim.free(live.pop(op[1]))
            elif op[0] == "empty_cache":
                sim.empty_cache()
        ooms += sim.num_ooms
    assert ooms > 0
