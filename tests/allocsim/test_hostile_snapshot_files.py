"""Small hostile snapshot and trace files end in one line and exit 2, fast, within 1.5 GiB (issue 19, items 1-2).

Every case runs the real command (`memtel whatif`, `memtel allocsim --from-snapshot`, `memtel forecast`) in a
subprocess whose address space is capped at 1.5 GiB (RLIMIT_AS): a reader that builds what the file describes
dies with a MemoryError traceback or is killed. The files are written here, opcode by opcode, in well under a
second each: a pickle of 10^7 distinct blocks (100 MB; the issue's 20 MB one held blocks
without fields), one whose shared references stand for 10^9 blocks, gzip files
that inflate to 1.9 GiB, and fields with odd values (a 5,001-digit integer, a pool_id of 5 or ["x", "y"]).
"""

from __future__ import annotations

import json
import pickle
import resource
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ADDRESS_SPACE_LIMIT = 1536 << 20  # 1.5 GiB
GIB = 1024**3
MIB = 1024**2


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def _su(text: str) -> bytes:  # SHORT_BINUNICODE
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _int(n: int) -> bytes:  # BININT (4 bytes) or LONG1
    if 0 <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data if len(data) < 256 else b"\x8b" + struct.pack("<i", len(data)) + data


def _items(*pairs: bytes) -> bytes:  # MARK key value ... SETITEMS, onto the dict on the stack
    return b"(" + b"".join(pairs) + b"u"


def distinct_blocks_pickle(count: int = 10**7) -> bytes:
    """[{'address': 0, 'total_size': 512 * count, 'blocks': [...]}]: `count` distinct valid blocks, 10 bytes each.

    Each block is MARK, BINGET 'size', BINGET 512, BINGET 'state', BINGET 'inactive', DICT: a new dict of 232
    bytes in memory for 10 bytes of file.
    """
    memo = _su("size") + b"\x94" + _int(512) + b"\x94" + _su("state") + b"\x94" + _su("inactive") + b"\x94" + b"0000"
    block = b"(h\x00h\x01h\x02h\x03d"
    batch = b"(" + block * 1000 + b"e"  # MARK, 1000 blocks, APPENDS
    blocks = b"]" + batch * (count // 1000)
    segment = b"}" + _items(_su("address") + _int(0), _su("total_size") + _int(512 * count), _su("blocks") + blocks)
    return b"\x80\x04" + memo + b"]" + segment + b"a."


def shared_blocks_pickle(segments: int = 10**6, per_segment: int = 1000) -> bytes:
    """{'segments': [S] * 10^6} where S's 'blocks' is [B] * 1000: 10^9 blocks read, ~2 MB of file."""
    block = b"}" + _items(_su("size") + _int(512), _su("state") + _su("inactive")) + b"\x94"  # MEMOIZE: memo 0
    blocks = b"]" + b"(" + b"h\x00" * per_segment + b"e"
    segment = b"}" + _items(_su("address") + _int(0), _su("total_size") + _int(512 * per_segment),
                            _su("blocks") + block + b"0" + blocks) + b"\x94"  # POP the extra ref; memo 1
    trace = _su("device_traces") + b"]]" + b"}" + _items(_su("action") + _su("alloc"), _su("addr") + _int(0),
                                                       _su("size") + _int(512)) + b"aa"  # [[{one alloc}]]
    top = b"}" + _items(_su("segments") + b"]" + segment + b"0" + b"(" + b"h\x01" * segments + b"e", trace)
    return b"\x80\x04" + top + b"."


def gzip_bomb(content_head: bytes, total: int = 1900 * MIB, fill: bytes = b"\x00") -> bytes:
    """A gzip file whose content is `content_head` then `fill` bytes up to `total`: about 1/1000 of that on disk.

    Its CRC is left 0 (computing it would read 1.9 GiB): a reader that gets that far has already failed.
    """
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = deflate.compress(content_head) + deflate.flush(zlib.Z_FULL_FLUSH)
    zeros = deflate.compress(fill * MIB) + deflate.flush(zlib.Z_FULL_FLUSH)  # the same bytes for every MiB
    body = head + zeros * ((total - len(content_head)) // MIB) + deflate.flush(zlib.Z_FINISH)
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + body + struct.pack("<II", 0, total % 2**32)


def _trace_doc(**entry_fields: object) -> dict:
    entry = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, **entry_fields}
    return {"device_traces": [[entry]], "segments": []}


def odd_integer_pickle() -> bytes:
    return pickle.dumps(_trace_doc(size=10**5001 - 1), protocol=4)


def odd_integer_json() -> bytes:
    segment = '{"address": 0, "total_size": ' + "9" * 5001 + ', "blocks": [{"size": 512, "state": "inactive"}]}'
    return ("[" + segment + "]").encode()


def odd_block_size_pickle() -> bytes:
    """A segment whose block size is a 5,001-digit integer (LONG4): no decimal parsing until an error message."""
    segments = [{"address": 0, "total_size": 512, "blocks": [{"size": 10**5001 - 1, "state": "inactive"}]}]
    return pickle.dumps({**_trace_doc(), "segments": segments}, protocol=4)


CASES: dict[str, tuple[Callable[[], bytes], str, tuple[str, ...]]] = {
    # name: (file content, file name, words the one-line error must hold)
    "10^7 distinct blocks": (distinct_blocks_pickle, "blocks.pickle", ("2,000,000 objects", "--max-objects")),
    "10^9 blocks by shared references": (shared_blocks_pickle, "shared.pickle",
                                         ("250,000 segments and blocks", "--max-blocks")),
    "gzip of 1.9 GiB of zeros": (lambda: gzip_bomb(b""), "zeros.pickle.gz", ("neither JSON nor a pickle",)),
    "gzip of a pickle holding 1.9 GiB of bytes": (
        lambda: gzip_bomb(b"\x80\x04\x8e" + struct.pack("<Q", 1900 * MIB - 11)), "bytes.pickle.gz", ("bytes",)),
    "gzip of 1.9 GiB of JSON": (lambda: gzip_bomb(b"[" + b" " * 100), "big.json.gz", ("--max-file-gb",)),
    "gzip of 1.9 GiB of white space": (lambda: gzip_bomb(b" ", fill=b" "), "spaces.json.gz", ("white space",)),
    "a 5,001-digit integer in a pickle": (odd_integer_pickle, "digits.pickle", ("integer", "bits")),
    "a 5,001-digit integer in JSON": (odd_integer_json, "digits.json", ("4300",)),
    "a 5,001-digit block size": (odd_block_size_pickle, "size.pickle", ("size", "bits")),
    "pool_id 5": (lambda: pickle.dumps(_trace_doc(pool_id=5)), "pool5.pickle", ("pool_id",)),
    "pool_id ['x', 'y']": (lambda: pickle.dumps(_trace_doc(pool_id=["x", "y"])), "poolxy.pickle", ("pool_id",)),
    "action a list": (lambda: pickle.dumps(_trace_doc(action=["alloc"])), "action.pickle", ("trace entry 0",)),
    "addr negative": (lambda: pickle.dumps(_trace_doc(addr=-1)), "addr.pickle", ("addr",)),
}
COMMANDS = {
    "whatif": lambda path: ["whatif", str(path)],
    "allocsim --from-snapshot": lambda path: ["allocsim", "OPS", "--from-snapshot", str(path)],
    "forecast": lambda path: ["forecast", "--snapshot", str(path), "--tokens", "1000"],
}
# Trace fields: only whatif reads traces (the snapshot readers take `segments` and ignore `device_traces`).
TRACE_ONLY = {"pool_id 5", "pool_id ['x', 'y']", "action a list", "addr negative", "a 5,001-digit integer in a pickle"}


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile")
    started = time.perf_counter()
    paths = {}
    for name, (make, filename, _) in CASES.items():
        paths[name] = folder / filename
        paths[name].write_bytes(make())
    assert time.perf_counter() - started < 15  # written quickly
    assert paths["10^7 distinct blocks"].stat().st_size < 110 * MIB
    assert paths["10^9 blocks by shared references"].stat().st_size < 3 * MIB
    assert paths["gzip of 1.9 GiB of zeros"].stat().st_size < 3 * MIB
    ops = folder / "ops.json"
    ops.write_text(json.dumps({"config": "", "cases": {"c": {"ops": [["malloc", 1, 5 * MIB], ["free", 1]]}}}))
    paths["ops"] = ops
    return paths


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    command = [sys.executable, "-m", "telemetry.cli", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60,
                              preexec_fn=_limit_address_space)
    except subprocess.TimeoutExpired:  # what the readers did before the limits: still building after a minute
        done = subprocess.CompletedProcess(command, -9, "", "timed out after 60 s")
    return done, time.perf_counter() - started


RUNS = [(case, command) for case in CASES for command in COMMANDS if command == "whatif" or case not in TRACE_ONLY]


@pytest.fixture(scope="module")
def outcomes(hostile_files) -> dict[tuple[str, str], tuple[subprocess.CompletedProcess[str], float]]:
    """Every (case, command) run once, four at a time (each is a short process; the machine has 2 cores)."""

    def one(run: tuple[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
        case, command = run
        args = COMMANDS[command](hostile_files[case])
        if command.startswith("allocsim"):
            args[1] = str(hostile_files["ops"])
        return _run(args)

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(RUNS, pool.map(one, RUNS), strict=True))


def test_the_files_are_what_they_claim():
    """The generators make what the cases say (checked on small sizes, without the limits)."""
    from telemetry.model.allocsim.snapshot_file import loads_data_pickle

    doc = loads_data_pickle(distinct_blocks_pickle(3000))
    blocks = doc[0]["blocks"]
    assert len(blocks) == 3000 and len({id(b) for b in blocks}) == 3000
    assert blocks[0] == {"size": 512, "state": "inactive"} and doc[0]["total_size"] == 512 * 3000
    doc = loads_data_pickle(shared_blocks_pickle(50, 20))
    assert len(doc["segments"]) == 50 and all(len(s["blocks"]) == 20 for s in doc["segments"])
    assert len({id(b) for s in doc["segments"] for b in s["blocks"]}) == 1  # one block, shared
    inflate = zlib.decompressobj(wbits=-15)  # the raw deflate stream after the 10-byte gzip header
    content = inflate.decompress(gzip_bomb(b"hello", 3 * MIB)[10:])
    assert inflate.eof and content.startswith(b"hello\x00") and len(content) == 5 + 2 * MIB  # whole MiBs of zeros


@pytest.mark.slow  # the 26 runs take 10-30 s together on the 2-core machine; the in-process checks below are fast
@pytest.mark.parametrize("case, command", RUNS, ids=[f"{case} | {command}" for case, command in RUNS])
def test_a_hostile_file_ends_in_one_line_and_exit_2_within_1_5_gib(outcomes, case, command):
    done, seconds = outcomes[(case, command)]
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    for word in CASES[case][2]:
        assert word in done.stderr, done.stderr
    assert seconds < 30, seconds  # four at a time on a busy 2-core machine; each takes about a second alone


def test_the_object_and_block_limits_are_flags():
    fixture = REPO / "tests/fixtures/allocator-snapshots/h200-torch2.11/whatif-recorded.pickle.gz"
    done, _ = _run(["whatif", str(fixture), "--max-objects", "1000"])
    assert done.returncode == 2 and "1,000 objects" in done.stderr and "--max-objects" in done.stderr
    done, _ = _run(["whatif", str(fixture), "--max-blocks", "1"])
    assert done.returncode == 2 and "1 segments and blocks" in done.stderr and "--max-blocks" in done.stderr
    done, _ = _run(["whatif", str(fixture), "--json"])  # the defaults take a real history, in 1.5 GiB
    assert done.returncode == 0, done.stderr


def test_the_limits_stop_the_readers_early_in_process():
    """The same limits, small: each refusal comes after reading a small part of the file."""
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.allocsim.snapshot_file import SnapshotFileError, parse_snapshot_bytes
    from telemetry.model.allocsim.trace import TraceError, read_trace

    with pytest.raises(SnapshotFileError, match=r"more than 10,000 objects .*--max-objects"):
        parse_snapshot_bytes(distinct_blocks_pickle(100_000), "x", max_objects=10_000)
    doc = parse_snapshot_bytes(shared_blocks_pickle(2000, 100), "x")  # 200,000 blocks read from 2,101 objects
    started = time.perf_counter()
    with pytest.raises(Exception, match=r"more than 5,000 segments and blocks .*--max-blocks"):
        read_allocator_state(doc, max_blocks=5000)
    assert time.perf_counter() - started < 1
    with pytest.raises(TraceError, match="more than 1 objects"):
        read_trace({"device_traces": [[{"action": "alloc", "addr": 0, "size": 1}] * 2]}, max_objects=1)
    with pytest.raises(SnapshotFileError, match="decompresses to more than"):
        parse_snapshot_bytes(gzip_bomb(b"[", 8 * MIB), "x", max_bytes=4 * MIB)
    with pytest.raises(TraceError, match="pool_id must be a pair of integers"):
        read_trace(_trace_doc(pool_id=["x", "y"]))
    with pytest.raises(TraceError, match="an integer of 16,610 bits"):
        read_trace(_trace_doc(size=10**5000))
