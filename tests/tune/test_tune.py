"""`memtel tune`: the search space's checks, the search against brute force, the CLI's output and bad input,
the rebuild of a state by allocating, and the verify probe's fresh process (the sim allocator)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from telemetry.cli import main
from telemetry.model.allocsim.config import parse_alloc_conf
from telemetry.model.allocsim.snapshot import load_allocator_state, read_allocator_state
from telemetry.model.fitsearch.rebuild import compare, rebuild
from telemetry.model.fitsearch.search import Outcome, Problem, evaluate, tune
from telemetry.model.fitsearch.space import SearchSpace, SearchSpaceError, expand, process_setting
from telemetry.model.fitsearch.verify import SnapshotSource, run_probe
from telemetry.model.indexer.backends import SimBackend
from telemetry.model.indexer.shape import MIB, IndexerShape
from telemetry.tune.engines import ENGINES, apply_settings, modes, paste_lines

SNAPSHOTS = Path(__file__).resolve().parents[1] / "fixtures" / "allocator-snapshots" / "h200-torch2.11"
SNAPSHOT = SNAPSHOTS / "seeded-default-stock-state24k.snapshot.json.gz"   # a real H200 snapshot, 35 segments
SHAPE = IndexerShape(layers=4, chunk=8192, compress_ratio=4, max_model_len=32_768, logits_budget_bytes=512 * MIB)
LIMIT = int(6.9 * 1024**3)   # the state holds 6.36 GiB live, 6.81 GiB reserved
SMALL_SPACE = SearchSpace(max_split_size_mb=(None, 256), roundup_power2_divisions=(None, 4),
                          budgets_bytes=(64 * MIB, 512 * MIB), chunks=(4096, 8192))


@pytest.fixture(scope="module")
def state():
    return load_allocator_state(SNAPSHOT)


def test_space_parses_every_setting_and_collapses_equal_ones(state) -> None:
    expanded = expand(SearchSpace(), SHAPE, "")
    confs = {s.alloc_conf for s in expanded.settings}
    assert len(confs) == 2 * 3 * 3   # expandable x max split x roundup; gc left out (no memory fraction)
    for conf in confs:
        parse_alloc_conf(conf)   # torch's rules
    assert any("garbage_collection_threshold not searched" in note for note in expanded.left_out)
    # "roundup_power2_divisions:1" and ... give distinct configs; the same config twice is one setting
    twice = expand(dataclasses.replace(SearchSpace(), roundup_power2_divisions=(None, None)), SHAPE, "")
    assert len({s.alloc_conf for s in twice.settings}) == 2 * 3


def test_gc_threshold_is_searched_under_a_memory_fraction() -> None:
    expanded = expand(SearchSpace(), SHAPE, "per_process_memory_fraction:0.5")
    confs = {s.alloc_conf for s in expanded.settings}
    assert any("garbage_collection_threshold:0.6" in c for c in confs)
    assert all("per_process_memory_fraction:0.5" in c for c in confs)   # the process's limit is kept


@pytest.mark.parametrize(("space", "words"), [
    (SearchSpace(max_split_size_mb=(19,)), "max_split_size_mb 19 (torch needs an integer of at least 20)"),
    (SearchSpace(roundup_power2_divisions=(3,)), "roundup_power2_divisions 3 (torch needs a power of two)"),
    (SearchSpace(garbage_collection_threshold=(1.0,)), "garbage_collection_threshold 1.0"),
    (SearchSpace(chunks=()), "an empty chunk list"),
])
def test_space_refuses_what_torch_would(space: SearchSpace, words: str) -> None:
    with pytest.raises(SearchSpaceError, match="search space: .*" + words.split(" (")[0]):
        expand(space, SHAPE, "")


def test_space_with_nothing_valid_says_why() -> None:
    with pytest.raises(SearchSpaceError, match="no setting to search: mode fixed: sglang has no switch for it"):
        expand(SearchSpace(modes=("fixed",)), SHAPE, "", engine_modes=("stock",), engine_name="sglang")
    with pytest.raises(SearchSpaceError, match="no setting to search: chunks above max-model-len 32,768"):
        expand(SearchSpace(chunks=(65_536,)), SHAPE, "")


def test_search_finds_the_brute_force_top_and_its_bounds_hold(state) -> None:
    """Every setting searched in full by brute force: the pruned search ranks the same best fits, and every
    setting it ruled out really fits no more than the bound it gave."""
    problem = Problem(state, SHAPE, LIMIT, 20_000)
    expanded = expand(SMALL_SPACE, SHAPE, "")
    result = tune(problem, expanded, process_setting(SHAPE, "", "stock"), top=3)
    exact = {s: evaluate(problem, s) for s in expanded.settings}
    brute = sorted(exact.values(), key=Outcome.rank_key)
    assert [o.rank_key()[:2] for o in result.ranked] == [o.rank_key()[:2] for o in brute[:3]]
    for o in result.ranked:
        assert o.fit is not None and o.fit.tokens == exact[o.setting].fit_tokens
    for o in result.pruned:   # searched in full and ranked below the top, or ruled out with a bound
        if o.fit is not None:
            assert o.fit.tokens == exact[o.setting].fit_tokens
        else:
            assert o.fit_at_most is not None and exact[o.setting].fit_tokens <= o.fit_at_most, o
    assert result.best.fit_tokens > result.process.fit_tokens   # the search found something better than today
    assert result.simulations < sum(o.fit.simulations for o in exact.values())   # pruning saved work


def test_limit_below_the_live_bytes_is_refused(state) -> None:
    with pytest.raises(Exception, match="below the state's live bytes"):
        Problem(state, SHAPE, state.counters.allocated_bytes - 1, 1000)


def test_lines_to_paste_give_the_setting() -> None:
    setting = dataclasses.replace(process_setting(SHAPE, "expandable_segments:True", "fixed"), budget_bytes=96 * MIB,
                                  chunk=4096)
    vllm = paste_lines(ENGINES["vllm"], setting, 0.85)
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in vllm
    assert "export VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=96" in vllm
    assert any(line.startswith("export VLLM_SPARSE_INDEXER_FIXED_LOGITS_WIDTH=1") for line in vllm)
    assert vllm[-1].endswith("--max-num-batched-tokens 4096 --gpu-memory-utilization 0.85")
    applied = apply_settings(ENGINES["sglang"], dataclasses.replace(setting, mode="stock"), None)
    assert applied["flags"] == ["--chunked-prefill-size", "4096"]
    assert "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB" not in applied["env"]


def test_tune_reads_each_engine_from_its_module() -> None:
    """Adding an engine stays one file: tune's engines are the registered ones that declare a `Tuning`, and
    telemetry/tune/engines.py types none of their names, presets, flags or variables (outside its docstrings)."""
    from telemetry.engines import ENGINES as REGISTERED

    assert {e.name: e for e in REGISTERED if e.tuning is not None} == ENGINES
    assert list(ENGINES) == ["vllm", "sglang", "lab"]
    words: set[str] = set()
    for engine in ENGINES.values():
        mode = "fixed" if "fixed" in modes(engine) else "stock"
        applied = apply_settings(engine, process_setting(SHAPE, "expandable_segments:True", mode), 0.5)
        words |= {engine.name, engine.tuning.preset, *applied["env"], *(f for f in applied["flags"] if f[:2] == "--")}
    words.discard("PYTORCH_CUDA_ALLOC_CONF")   # every engine's: tune sets it itself
    tree = ast.parse((Path(__file__).parents[2] / "telemetry" / "tune" / "engines.py").read_text())
    documentation = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    strings = [n.value for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in documentation]
    typed = sorted({w for w in words for text in strings if re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", text)})
    assert len(words) > 10 and typed == []


@pytest.mark.parametrize("name", ["seeded-default-stock-state24k", "seeded-default-fixed-state64k"])
def test_rebuild_by_allocating_reproduces_the_snapshot(name: str) -> None:
    state = load_allocator_state(SNAPSHOTS / f"{name}.snapshot.json.gz")
    backend = SimBackend("")
    kept = rebuild(backend, state)
    got = read_allocator_state(backend.snapshot())
    assert compare(state, got) is None
    assert got.counters.reserved_bytes == state.counters.reserved_bytes
    assert got.counters.allocated_bytes == state.counters.allocated_bytes
    assert len(kept) == state.live_blocks()


def test_rebuild_makes_free_small_segments_from_small_pieces() -> None:
    """A small segment whose 2 MiB are all free cannot come from one request (2 MiB goes to the large pool)."""
    made = SimBackend("")
    slots = [[made.alloc(MIB), made.alloc(MIB)] if i % 2 else [made.alloc((10 + 2 * (i // 2 % 4)) * MIB)]
             for i in range(40)]
    for i, blocks in enumerate(slots):
        if i % 4 >= 2:
            for block in blocks:
                made.release(block)
    state = read_allocator_state(made.snapshot())
    assert any(s.small and not s.allocated_bytes for s in state.segments)
    backend = SimBackend("")
    rebuild(backend, state)
    assert compare(state, read_allocator_state(backend.snapshot())) is None


def test_a_verify_probe_runs_in_a_fresh_process_and_agrees(state) -> None:
    problem = Problem(state, SHAPE, LIMIT, 20_000)
    setting = process_setting(SHAPE, "", "stock")
    outcome = evaluate(problem, setting)
    source = SnapshotSource(str(SNAPSHOT), None, 1 << 30, 10**6, 10**6)
    fits = run_probe(problem, source, outcome, outcome.fit_tokens, "sim")
    assert fits.fits and fits.peak_reserved_bytes == outcome.fit.peak_reserved_bytes


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["tune", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


CORE = ["--snapshot", str(SNAPSHOT), "--target-tokens", "20000", "--memory-gb", "6.9", "--layers", "4",
        "--max-model-len", "32768", "--chunks", "4096,8192", "--top", "2"]
BASE = [*CORE, "--budgets-mb", "64,512"]


def test_cli_json_ranks_and_says_what_to_paste(capsys) -> None:
    code, out, err = run_cli(capsys, *BASE, "--json", "--total-memory-gb", "140", "--gpu-memory-utilization", "0.5")
    assert code == 0, err
    doc = json.loads(out)
    best = doc["ranked"][0]
    assert best["max_fit_tokens"] >= doc["process"]["max_fit_tokens"]
    assert best["apply"]["env"]["PYTORCH_CUDA_ALLOC_CONF"] == best["setting"]["alloc_conf"]
    assert doc["lines"][-1].startswith("vllm serve MODEL ... --max-num-batched-tokens")
    assert doc["utilization"] is not None and 0.5 <= doc["utilization"] <= 1.0


def test_cli_table(capsys) -> None:
    code, out, _ = run_cli(capsys, *BASE)
    assert code == 0
    assert "longest fit" in out and " now " in out and "lines to paste (vllm):" in out
    assert "export VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=64" in out


@pytest.mark.parametrize(("args", "words"), [
    (["--roundup", "3"], "roundup_power2_divisions 3 (torch needs a power of two)"),
    (["--max-split-mb", "16"], "max_split_size_mb 16"),
    (["--engine", "sglang", "--modes", "fixed"], "no setting to search: mode fixed: sglang has no switch"),
    (["--engine", "sglang", "--budgets-mb", "64"], "sglang sizes the logits budget itself"),
    (["--target-tokens", "40000"], "longer than max-model-len 32,768"),
    (["--memory-gb", "1"], "below the state's live bytes"),
    (["--plot", "x.svg"], "expected a .png file name"),
    (["--preset", "vllm-sparse-indexer-decode"], "not a prefill-logits preset"),
    (["--gc-threshold", "1.5"], "garbage_collection_threshold 1.5"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, args: list[str], words: str) -> None:
    code, out, err = run_cli(capsys, *CORE, *args)
    assert code == 2 and not out
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


def test_the_memory_limit_error_writes_every_byte_count_the_same_way(capsys) -> None:
    code, _, err = run_cli(capsys, *CORE, "--memory-gb", "1")
    assert code == 2 and "(1,073,741,824 bytes) is below the state's live bytes (" in err, err


def test_cli_hostile_snapshot_gets_forecasts_limits(capsys, tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_text("[" + "{}," * 2000 + "{}]")
    code, _, err = run_cli(capsys, *[a if a != str(SNAPSHOT) else str(big) for a in BASE], "--max-objects", "100")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    pickle_bomb = tmp_path / "evil.pickle"
    pickle_bomb.write_bytes(b"cos\nsystem\n(S'echo hi'\ntR.")
    code, _, err = run_cli(capsys, *[a if a != str(SNAPSHOT) else str(pickle_bomb) for a in BASE])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err


def test_cli_node_headroom_reads_this_node(capsys) -> None:
    args = [a for a in CORE if a not in ("--memory-gb", "6.9")]
    code, out, err = run_cli(capsys, *args, "--node-headroom", "--json")
    if code == 2:   # the node's headroom less the reserve is less than this state's live bytes: said in one line
        assert "below the state's live bytes" in err and err.count("\n") == 1
    else:
        doc = json.loads(out)
        assert doc["limit"].startswith("the node's headroom: node headroom") and doc["limit_bytes"] > 0


def test_cli_plot(capsys, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    code, _, err = run_cli(capsys, *BASE, "--plot", str(tmp_path / "fit.png"))
    assert code == 0, err
    assert (tmp_path / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_verify_on_the_sim_allocator(capsys) -> None:
    """--verify: the top setting and today's run again, a fresh process per prefill; predicted equals real."""
    code, out, err = run_cli(capsys, *BASE, "--verify", "1", "--verify-allocator", "sim", "--json")
    assert code == 0, err
    verified = json.loads(out)["verify"]["settings"]
    assert len(verified) == 2 and all(v["agrees"] for v in verified)
    assert all(v["real_fit_tokens"] == v["predicted_fit_tokens"] for v in verified)
