"""A snapshot's bad value is quoted short (issue 27: a 1 MB pickle with a huge block address gave a 2 MB error
line, the address written out in hex). Both readers of a snapshot file, `memtel forecast --snapshot` and
`memtel allocsim --from-snapshot`, answer one short line, exit 2."""

from __future__ import annotations

import json
import pickle

import pytest

from tests.support.cli import call_main

MIB = 1 << 20


def cli(*argv: str) -> tuple[int, str, str]:
    """`memtel ARGV` in-process (tests/support/cli.py): (exit code, stdout, stderr)."""
    run = call_main(list(argv))
    return run.returncode, run.stdout, run.stderr


@pytest.fixture
def huge_address_snapshot(tmp_path):
    segment = {"device": 0, "address": 0, "total_size": 2 * MIB, "segment_type": "large", "stream": 0,
               "blocks": [{"size": MIB, "state": "active_allocated", "address": 0},
                          {"size": MIB, "state": "inactive", "address": 1 << (8 * 1_000_000)}]}
    path = tmp_path / "huge.pickle"
    path.write_bytes(pickle.dumps({"segments": [segment], "device_traces": []}))
    assert path.stat().st_size > 1_000_000
    return path


def test_forecast_and_allocsim_quote_a_huge_block_address_short(tmp_path, huge_address_snapshot):
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps({"cases": {"a": {"ops": []}}}))
    for argv in (("forecast", "--snapshot", str(huge_address_snapshot), "--tokens", "10"),
                 ("allocsim", str(ops), "--from-snapshot", str(huge_address_snapshot))):
        code, out, err = cli(*argv)
        assert code == 2 and out == "" and "Traceback" not in err
        (line,) = err.strip().splitlines()
        assert len(line) < 300 and "block 1: address an integer of 8,000,001 bits" in line, line[:300]
