"""The native snapshot reader's CPU side: its bytes format, the forecast fed with bytes, and when it is off.

The extension itself runs on the GPU machine (test_forecast_snapshot_native_gpu.py: its bytes decode to exactly
torch's snapshot). Here the bytes are made by `encode_snapshot` from segments in torch's format: they decode back
exactly, hostile or cut bytes are one SnapshotBytesError (never another exception), the forecast thread fed bytes
(through its helper process and in-process) exports what it exports from the segments, compares bytes to skip an
unchanged allocator, and counts bad bytes as a failed snapshot. The reader is off, said once, where it cannot be
had (MEMTEL_FORECAST_SNAPSHOT=python, a torch without CUDA, a failed or overlong build, a library that is not this
user's), and its build runs in the background: taking a snapshot never waits for it.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
import types

import pytest

from telemetry.fit_budget import set_forecast_budget
from telemetry.hook import set_allocator_source
from telemetry.hook.forecast import set_forecast_workload
from telemetry.hook.forecast.runner import SNAPSHOT, Forecaster
from telemetry.hook.forecast.snapshot_native import build
from telemetry.hook.forecast.snapshot_native.codec import (
    SnapshotBytesError,
    decode_snapshot,
    encode_snapshot,
    torch_fields,
)
from telemetry.hook.forecast.snapshot_native.reader import ALLOCATOR_SOURCE, MEMORY_SNAPSHOT, NativeSnapshots
from telemetry.model.allocsim.snapshot import SnapshotError, read_allocator_state
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.prefill import run_prefill
from telemetry.model.indexer.shape import MIB, IndexerShape

SHAPE = IndexerShape(layers=4, chunk=1024, compress_ratio=4, max_model_len=65536, logits_budget_bytes=64 * MIB)
HUGE = 2**64 - 1


def messy_segments() -> list[dict]:
    """torch's format, with every key torch writes (some the reader drops) and every kind of segment and block."""
    def segment(address, blocks, **extra):
        base = {"device": 0, "address": address, "total_size": sum(b[0] for b in blocks), "allocated_size": 0,
                "active_size": 0, "requested_size": 0, "stream": 0, "segment_type": "large",
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": []}
        cursor, out = address, []
        for size, state in blocks:
            out.append({"address": cursor, "size": size, "requested_size": size - 1, "state": state, "frames": []})
            cursor += size
        return {**base, **extra, "blocks": out}

    return [
        segment(0x7F0000000000, [(2 * MIB, "active_allocated")]),
        segment(0x7F0000400000, [(512, "active_allocated"), (1536, "inactive"), (2 * MIB - 2048, "inactive")],
                segment_type="small"),
        segment(0x7F0001000000, [(4 * MIB, "active_pending_free"), (16 * MIB, "active_allocated")]),
        segment(0x7F0004000000, [(6 * MIB, "active_allocated")], segment_pool_id=(1, 7)),
        segment(0x7E0000000000, [(40 * MIB, "active_allocated"), (24 * MIB, "inactive")], is_expandable=True),
        segment(0x7F0010000000, [(20 * MIB, "inactive")], stream=0x55D0C0FFEE00),
        segment(HUGE - (1 << 30), [(1 << 20, "inactive")], device=1, stream=HUGE),
    ]


# ---- the format ----------------------------------------------------------------------------------------------


def read(doc, device):
    try:
        return read_allocator_state(doc, device=device, source="s")
    except SnapshotError as error:
        return f"SnapshotError: {error}"


def test_constructed_bytes_decode_to_torchs_segments_and_the_same_state():
    segments = messy_segments()
    data = encode_snapshot(segments)
    decoded = decode_snapshot(data)
    assert decoded == torch_fields(segments)
    assert len(data) == 16 + 56 * 7 + 16 * 11
    for device in (0, 1):
        assert read(decoded, device) == read(segments, device)
    assert "several CUDA streams" in read(decoded, 0)   # the same refusal either way
    one_stream = [s for s in segments if s["stream"] == 0]
    state = read(decode_snapshot(encode_snapshot(one_stream)), 0)
    assert state == read(one_stream, 0)
    assert state.private_segments and state.pending_free_bytes == 4 * MIB and any(s.expandable for s in state.segments)


def test_bytes_of_a_simulated_rank_decode_exactly():
    backend = SimBackend("")
    run_prefill(backend, SHAPE, "stock", 3000)
    backend.alloc(3 * MIB)
    segments = backend.snapshot()
    assert decode_snapshot(encode_snapshot(segments)) == torch_fields(segments)
    assert decode_snapshot(encode_snapshot([])) == []


def corrupt(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


VALID = encode_snapshot(messy_segments())


@pytest.mark.parametrize(("data", "match"), [
    (b"", "shorter than its 16-byte header"),
    (b"MTAS\x01\x00", "shorter than its 16-byte header"),
    (corrupt(VALID, 0, b"PK\x03\x04"), "not a native allocator snapshot: it starts with b'PK"),
    (corrupt(VALID, 4, b"\x02\x00"), "format 2.0: this memtel reads 1.0"),
    (corrupt(VALID, 6, b"\x01\x00"), "format 1.1"),
    (corrupt(VALID, 8, (10**9).to_bytes(4, "little")), "over the 250,000-object bound"),
    (VALID[:-1], "takes 584 bytes, got 583"),
    (VALID + b"\0", "got 585"),
    (corrupt(VALID, 8, (8).to_bytes(4, "little")), "8 segments and 11 blocks takes"),
    (corrupt(VALID, 16 + 4, (4).to_bytes(4, "little")), "segment 0: unknown flags 0x4"),
    (corrupt(VALID, 16 + 52, (1).to_bytes(4, "little")), "segment 0: unknown flags"),
    (corrupt(VALID, 16 + 48, (12).to_bytes(4, "little")), "segment 0: 12 blocks where the header leaves 11"),
    (corrupt(VALID, 16 + 56 + 8, b"\x03"), "segment 0, block 0: unknown state 3"),
], ids=["empty", "short-header", "magic", "version", "reserved", "too-many", "one-short", "one-long",
        "segment-count", "flags", "padding", "block-count", "state"])
def test_hostile_bytes_are_one_clean_error(data, match):
    with pytest.raises(SnapshotBytesError, match=match):
        decode_snapshot(data)


def test_a_segment_count_that_leaves_blocks_over_is_refused():
    # Two segments of one block each, the header says 3 blocks and one more block's bytes follow (length agrees).
    two = [{"address": 0x1000000, "total_size": 2 * MIB, "blocks": [{"size": 2 * MIB, "state": "inactive"}]},
           {"address": 0x2000000, "total_size": 2 * MIB, "blocks": [{"size": 2 * MIB, "state": "inactive"}]}]
    data = corrupt(encode_snapshot(two), 12, (3).to_bytes(4, "little")) + bytes(16)
    with pytest.raises(SnapshotBytesError, match="the header counts 3 blocks, its segments 2"):
        decode_snapshot(data)


def test_not_bytes_is_refused_and_the_object_bound_is_the_callers():
    with pytest.raises(SnapshotBytesError, match="is bytes, got list"):
        decode_snapshot([])  # type: ignore[arg-type]
    with pytest.raises(SnapshotBytesError, match="over the 10-object bound"):
        decode_snapshot(VALID, max_objects=10)


def test_every_cut_and_random_damage_is_a_clean_error_or_a_snapshot_the_reader_judges():
    for end in range(len(VALID)):
        with pytest.raises(SnapshotBytesError):
            decode_snapshot(VALID[:end])
    rng = random.Random(22)
    decoded_some = 0
    for _ in range(400):
        data = bytearray(VALID)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            segments = decode_snapshot(bytes(data))
        except SnapshotBytesError:
            continue
        decoded_some += 1
        try:   # what decodes is judged by the same reader as torch's segments: a state or a SnapshotError
            read_allocator_state(segments, device=0)
        except SnapshotError:
            pass
    assert decoded_some > 0   # damage to addresses and sizes decodes: the reader's checks were reached


# ---- the forecast fed with bytes ---------------------------------------------------------------------------------


def sim_rank(as_bytes: bool) -> SimBackend:
    backend = SimBackend("")
    run_prefill(backend, SHAPE, "stock", 3000)
    backend.alloc(3 * MIB)
    snapshot = (lambda: encode_snapshot(backend.snapshot())) if as_bytes else backend.snapshot
    set_allocator_source(backend.counters, snapshot=snapshot)
    set_forecast_workload(SHAPE)
    set_forecast_budget(lambda: 90 * MIB, reserve_mib=20)
    return backend


@pytest.mark.parametrize("helper", [True, False])
def test_bytes_give_the_forecasts_and_the_longest_fit_that_the_segments_give(helper):
    answers = []
    live = Forecaster((4096, 20000), 5.0, environ={}, helper=helper)   # one helper process for both
    try:
        for as_bytes in (False, True):
            sim_rank(as_bytes)
            assert live.run_once(), live.results.failures
            answers.append((live.results.forecasts, live.results.max_fit, live.results.budget))
            assert live.results.snapshot_reader == ALLOCATOR_SOURCE
    finally:
        live.stop()
    assert answers[0] == answers[1]
    assert answers[0][0] and answers[0][1] is not None and 0 < answers[0][1].tokens < SHAPE.max_model_len


def test_equal_bytes_are_not_simulated_again_and_changed_ones_are():
    backend = sim_rank(True)
    live = Forecaster((4096,), 5.0, environ={})
    sent = []
    real = live._helper.cycle
    live._helper.cycle = lambda request, segments, pause: sent.append(type(segments)) or real(  # type: ignore
        request, segments, pause)
    try:
        assert live.run_once() and live.run_once()
        assert sent == [bytes]          # the second cycle compared bytes and sent nothing
        backend.alloc(5 * MIB)
        assert live.run_once()
        assert sent == [bytes, bytes]
    finally:
        live.stop()


@pytest.mark.parametrize("helper", [True, False])
def test_bad_bytes_count_as_a_failed_snapshot_and_leave_the_forecast_out(helper):
    sim_rank(False)
    set_allocator_source(lambda: {"reserved_bytes": 0, "allocated_bytes": 0, "num_device_alloc": 0,
                                  "num_device_free": 0, "num_alloc_retries": 0, "num_ooms": 0},
                         snapshot=lambda: VALID[:-3])
    live = Forecaster((4096,), 5.0, environ={}, helper=helper)
    try:
        assert not live.run_once()
    finally:
        live.stop()
    assert live.results.failures == {SNAPSHOT: 1}
    assert live.results.forecasts == ()


# ---- the reader: off, said once; built in the background ------------------------------------------------------


def fake_cuda_torch() -> types.SimpleNamespace:
    return types.SimpleNamespace(__version__="9.9.9+test", version=types.SimpleNamespace(cuda="13.0",
                                                                                         git_version="abc"))


def test_python_is_asked_for_quietly_and_a_bad_choice_is_one_line(caplog):
    caplog.set_level(logging.INFO, "memtel.hook")
    quiet = NativeSnapshots({"MEMTEL_FORECAST_SNAPSHOT": "python"})
    assert quiet.take() is None and quiet.take() is None
    assert quiet.off == "MEMTEL_FORECAST_SNAPSHOT=python" and quiet.reader == MEMORY_SNAPSHOT
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    caplog.clear()
    bad = NativeSnapshots({"MEMTEL_FORECAST_SNAPSHOT": "fast"})
    for _ in range(3):
        assert bad.take() is None
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    assert "MEMTEL_FORECAST_SNAPSHOT='fast': expected one of native, python" in caplog.text
    assert 'memtel_forecast_snapshot_reader_info{reader="memory_snapshot"}' in caplog.text


def test_a_torch_without_cuda_turns_it_off(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(version=types.SimpleNamespace(cuda=None)))
    reader = NativeSnapshots({})
    assert reader.take() is None and reader.off == "this torch has no CUDA"


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_build_runs_in_the_background_and_its_failure_turns_it_off(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch", fake_cuda_torch())
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    # The build: a process that waits for a file, then fails as build.main does (failed.txt, exit 1).
    go = tmp_path / "go"
    script = ("import os, sys, time\n"
              f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
              "open(os.path.join(sys.argv[1], 'failed.txt'), 'w').write('no compiler\\n'); sys.exit(1)\n")
    reader = NativeSnapshots(env, command=[sys.executable, "-c", script, str(build.build_directory(
        sys.modules["torch"], env))])
    assert reader.take() is None and reader.building   # returned at once: the build runs on
    directory = reader.directory
    assert directory is not None and directory.parent.parent.parent == tmp_path
    assert [oct(os.stat(p).st_mode & 0o777) for p in (directory, directory.parent, directory.parent.parent)] == \
        ["0o700"] * 3
    assert reader.take() is None and reader.building and reader.off is None
    go.touch()
    wait_for(lambda: reader.take() is None and not reader.building)
    assert reader.off.startswith("its build failed (no compiler; log: ")
    # The next process does not try again: the failure is in the cache.
    again = NativeSnapshots(env, command=[sys.executable, "-c", "raise SystemExit('must not run')"])
    assert again.take() is None and not again.building
    assert again.off.startswith(f"its build in {directory} failed (no compiler; delete the folder")


def test_a_build_that_takes_too_long_is_ended(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_cuda_torch())
    now = [0.0]
    reader = NativeSnapshots({"XDG_CACHE_HOME": str(tmp_path)}, timeout_s=60.0, clock=lambda: now[0],
                             command=[sys.executable, "-c", "import time; time.sleep(60)"])
    assert reader.take() is None and reader.building
    process = reader._build
    now[0] = 61.0
    assert reader.take() is None and not reader.building
    assert process.returncode is not None and reader.off.startswith("its build took over 60 s")


@pytest.mark.parametrize("plant", ["link", "writable", "folder-writable"])
def test_a_library_that_is_not_this_users_own_is_never_loaded(tmp_path, monkeypatch, plant):
    monkeypatch.setitem(sys.modules, "torch", fake_cuda_torch())
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    directory = build.build_directory(sys.modules["torch"], env)
    build.private_directory(directory)
    library = build.library_path(directory)
    elsewhere = tmp_path / "evil.so"
    elsewhere.write_bytes(b"\x7fELF not really")
    if plant == "link":
        library.symlink_to(elsewhere)
    else:
        library.write_bytes(elsewhere.read_bytes())
        os.chmod(library if plant == "writable" else directory, 0o777 if plant == "folder-writable" else 0o666)
    reader = NativeSnapshots(env, command=[sys.executable, "-c", "raise SystemExit('must not run')"])
    assert reader.take() is None and reader.module is None and not reader.building
    expected = {"link": "is not a plain file (a link?)", "writable": "is writable by others (mode 666)",
                "folder-writable": "is writable by others (mode 777)"}[plant]
    assert expected in reader.off


def test_the_reader_in_use_is_exported_once_a_snapshot_was_taken():
    from prometheus_client.registry import CollectorRegistry

    from telemetry.hook.forecast.collector import ForecastCollector
    from telemetry.hook.forecast.runner import ForecastResults
    from telemetry.hook.state import HookState

    def samples(reader):
        registry = CollectorRegistry()
        forecaster = types.SimpleNamespace(results=ForecastResults(snapshot_reader=reader))
        registry.register(ForecastCollector(forecaster, HookState(node="n1", targets={})))  # type: ignore[arg-type]
        return [(s.labels, s.value) for m in registry.collect() if m.name == "memtel_forecast_snapshot_reader_info"
                for s in m.samples]

    assert samples(None) == []   # no snapshot yet: nothing said
    assert samples("native") == [({"reader": "native", "rank": "0", "node": "n1"}, 1.0)]
