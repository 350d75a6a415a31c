"""The longest prefill that fits (telemetry/model/indexer/fit.py) against simulating every length.

For small shapes, seeded from varied allocator states and under several allocator settings, the search's
answer must equal the brute force's: the largest N such that every prefill of 1..N tokens runs without the
simulator running out of the limit. The cases include those where a shorter prefill needs more than a longer
one (a short last chunk in the small pool or the 20 MiB buffers where the full chunk reuses a cached block).
"""

from __future__ import annotations

import random

import pytest

from telemetry.errors import ConfigError
from telemetry.model.allocsim.snapshot import read_allocator_state
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.fit import max_prefill_tokens
from telemetry.model.indexer.forecast import forecast
from telemetry.model.indexer.prefill import LaunchPattern, run_prefill
from telemetry.model.indexer.shape import IndexerShape
from tests.support.cli import call_main

MIB = 1 << 20
SHAPE = IndexerShape(layers=2, chunk=256, compress_ratio=1, max_model_len=1500, logits_budget_bytes=2 * MIB)


def brute_force(state, shape, limit, **kwargs) -> int:
    for tokens in range(1, shape.max_model_len + 1):
        if forecast(state, shape, tokens, capacity_bytes=limit, **kwargs).out_of_memory:
            return tokens - 1
    return shape.max_model_len


def warm_state(conf: str, seed: int, shape: IndexerShape, mode: str, pattern: LaunchPattern):
    """An allocator that served a prefill and holds a few live tensors of random sizes."""
    rng = random.Random(seed)
    backend = SimBackend(conf)
    run_prefill(backend, shape, mode, rng.randrange(100, 900), pattern=pattern)
    kept = [backend.alloc(rng.choice([300_000, 700 * 1024, 3 * MIB, 12 * MIB + 4096])) for _ in range(rng.randrange(4))]
    assert len(kept) < 4
    return read_allocator_state(backend.snapshot())


CASES = [
    ("", "stock", SHAPE, LaunchPattern()),
    ("", "fixed", SHAPE, LaunchPattern()),
    ("expandable_segments:True", "stock", SHAPE, LaunchPattern()),
    ("expandable_segments:True", "fixed", SHAPE, LaunchPattern()),
    ("max_split_size_mb:20", "fixed", IndexerShape(layers=1, chunk=1024, compress_ratio=1, max_model_len=6000,
                                                   logits_budget_bytes=64 * MIB), LaunchPattern()),
    ("roundup_power2_divisions:4", "fixed", SHAPE, LaunchPattern()),
    ("", "stock", IndexerShape(layers=2, chunk=200, compress_ratio=2, max_model_len=1300,
                               logits_budget_bytes=MIB, topk=64), LaunchPattern(transient_bytes=1536 * 1024)),
    ("", "stock", SHAPE, LaunchPattern(keep_previous=False, row_scale=0.5)),
]


def check_against_brute_force(conf, mode, shape, pattern, seeds, extras_mib) -> list[tuple[int, bool]]:
    """Search == brute force for every state and limit; [(answer, whether the longest prefill fits alone)]."""
    answers = []
    for seed in seeds:
        state = warm_state(conf, seed, shape, mode, pattern)
        for extra_mib in extras_mib:
            limit = state.counters.allocated_bytes + extra_mib * MIB
            found = max_prefill_tokens(state, shape, limit_bytes=limit, mode=mode, alloc_conf=conf, pattern=pattern)
            expected = brute_force(state, shape, limit, mode=mode, alloc_conf=conf, pattern=pattern)
            assert found.tokens == expected, (seed, extra_mib, found)
            assert found.first_misfit == (expected + 1 if expected < shape.max_model_len else None)
            assert found.simulations < 40
            longest = forecast(state, shape, shape.max_model_len, capacity_bytes=limit, mode=mode, alloc_conf=conf,
                               pattern=pattern)
            answers.append((expected, not longest.out_of_memory))
    return answers


def test_the_search_equals_simulating_every_length_where_a_short_chunk_needs_more():
    # fixed width: a last chunk of a few rows is a small-pool request that needs a new 2 MiB segment, where the
    # full chunk reuses a cached large block: the boundaries alone would say far too much fits.
    answers = check_against_brute_force("", "fixed", SHAPE, LaunchPattern(), seeds=(0,), extras_mib=(0, 9, 30))
    assert any(answer < SHAPE.chunk and longest_fits for answer, longest_fits in answers), answers
    assert len({answer for answer, _ in answers}) >= 2, answers   # the limits cut the lengths in different places


@pytest.mark.slow
@pytest.mark.parametrize(("conf", "mode", "shape", "pattern"), CASES)
def test_the_search_equals_simulating_every_length(conf, mode, shape, pattern):
    heavy = shape.max_model_len > 2000
    check_against_brute_force(conf, mode, shape, pattern, seeds=(0,) if heavy else (0, 1, 2),
                              extras_mib=(0, 24, 60, 130) if heavy else (0, 3, 9, 17, 30))


def test_the_peak_is_the_answers_own_and_within_the_limit():
    state = warm_state("", 1, SHAPE, "stock", LaunchPattern())
    limit = state.counters.allocated_bytes + 9 * MIB
    found = max_prefill_tokens(state, SHAPE, limit_bytes=limit)
    assert 0 < found.tokens < SHAPE.max_model_len
    own = forecast(state, SHAPE, found.tokens, capacity_bytes=limit)
    assert not own.out_of_memory and own.peak_reserved_bytes == found.peak_reserved_bytes <= limit
    assert forecast(state, SHAPE, found.tokens + 1, capacity_bytes=limit).out_of_memory


def test_no_room_fits_nothing_and_max_tokens_bounds_the_answer():
    state = read_allocator_state([])
    assert max_prefill_tokens(state, SHAPE, limit_bytes=0).tokens == 0
    assert max_prefill_tokens(state, SHAPE, limit_bytes=1 << 40, max_tokens=700).tokens == 700
    assert max_prefill_tokens(state, SHAPE, limit_bytes=1 << 40, max_tokens=0).tokens == 0


@pytest.mark.parametrize("limit", [-1, 1.5, True, "8"])
def test_a_bad_limit_is_a_config_error(limit):
    with pytest.raises(ConfigError, match="limit"):
        max_prefill_tokens(read_allocator_state([]), SHAPE, limit_bytes=limit)


def test_memtel_forecast_max_fit_prints_the_search_from_a_saved_snapshot(tmp_path):
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    backend = SimBackend("")
    keep = backend.alloc(300_000)   # one small-pool segment with a live block
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(json.dumps(backend.snapshot()))
    assert keep is not None
    shape_args = ["--layers", "2", "--chunk", "256", "--compress-ratio", "1", "--max-model-len", "1500",
                  "--budget-mb", "2"]
    capacity_gib = 12 / 1024
    command = ["forecast", "--snapshot", str(snapshot), "--max-fit", "--capacity-gb", str(capacity_gib), *shape_args]
    done = call_main([*command, "--json"], cwd=root)
    assert done.returncode == 0, done.stderr
    expected = max_prefill_tokens(read_allocator_state(backend.snapshot()), SHAPE, limit_bytes=12 * MIB)
    assert json.loads(done.stdout)["max_fit"] == expected.as_json()
    assert 0 < expected.tokens < SHAPE.max_model_len
    table = call_main(command, cwd=root)
    assert "longest prefill that fits in 12 MiB" in table.stdout and f"{expected.tokens:,} tokens" in table.stdout
    for bad, says in [(["--max-fit"], "--max-fit needs --capacity-gb"), ([], "give --tokens")]:
        wrong = call_main(["forecast", "--snapshot", str(snapshot), *bad], cwd=root)
        assert wrong.returncode == 2 and says in wrong.stderr and len(wrong.stderr.strip().splitlines()) == 1, wrong
