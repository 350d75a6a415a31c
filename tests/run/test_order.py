"""The run's order (telemetry/hook/run_order.py) and the rank sources memtel run adds (telemetry/hook/rank.py).

Processes of one run that start at the same moment take distinct numbers; the counter is a private file
that is never followed through a symlink; an engine's world group (vLLM's or SGLang's) names the rank.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import types
from pathlib import Path

import pytest

from telemetry.hook import rank as rank_module
from telemetry.hook import run_order as order
from telemetry.hook.rank import RankInfo, resolve_rank


@pytest.fixture
def run_dir(tmp_path) -> Path:
    base = tmp_path / "runtime"
    return order.create_run_dir(base, os.getpid())


def _take_many(directory: str, count: int, queue) -> None:
    queue.put([order.take(directory) for _ in range(count)])


def test_processes_taking_numbers_at_once_never_get_the_same_one(run_dir):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_take_many, args=(str(run_dir), 25, queue)) for _ in range(4)]
    for worker in workers:
        worker.start()
    numbers = [n for _ in workers for n in queue.get(timeout=120)]
    for worker in workers:
        worker.join(timeout=60)
    assert sorted(numbers) == list(range(100))
    assert order.peek(run_dir) == 100


def test_the_counter_is_never_read_through_a_symlink_or_in_a_shared_directory(tmp_path, run_dir):
    counter = run_dir / order.ORDER_FILE
    counter.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("41")
    counter.symlink_to(elsewhere)
    assert order.take(run_dir) is None and order.peek(run_dir) is None
    assert elsewhere.read_text() == "41"
    counter.unlink()
    counter.write_text("3")
    os.chmod(run_dir, 0o777)
    assert order.take(run_dir) is None   # a directory others can write is not the run's
    os.chmod(run_dir, 0o700)
    assert order.take(run_dir) == 3 and order.peek(run_dir) == 4


def test_a_damaged_counter_gives_no_number(run_dir):
    (run_dir / order.ORDER_FILE).write_text("not a number")
    assert order.take(run_dir) is None


def test_only_one_process_is_first(run_dir):
    assert order.claim_first(run_dir) is True
    assert order.claim_first(run_dir) is False


def test_stale_run_directories_go_live_ones_stay(tmp_path):
    base = tmp_path / "runtime"
    mine = order.create_run_dir(base, os.getpid())
    gone = base / "run-999999999-0123abcd"   # no such pid
    gone.mkdir()
    (gone / order.ORDER_FILE).write_text("2")
    unrelated = base / "notes"
    unrelated.mkdir()
    assert order.remove_stale(base) == [gone]
    assert mine.is_dir() and unrelated.is_dir() and not gone.exists()


def test_the_run_order_is_taken_once_per_process_when_the_hook_starts(monkeypatch, run_dir):
    monkeypatch.setattr(rank_module, "_order", None)
    environ = {order.RUN_DIR_ENV: str(run_dir)}
    assert resolve_rank(environ) == RankInfo(0, 0, "default")   # a scrape before the start takes nothing
    assert order.peek(run_dir) == 0
    assert resolve_rank(environ, start=True) == RankInfo(0, 0, "run order")
    assert resolve_rank(environ, start=True) == RankInfo(0, 0, "run order")   # once per process
    assert order.peek(run_dir) == 1
    # A ranked process takes its number too (unranked ones come after it), but keeps its rank.
    monkeypatch.setattr(rank_module, "_order", None)
    assert resolve_rank({**environ, "RANK": "3", "LOCAL_RANK": "1"}, start=True) == RankInfo(3, 1, "env")
    assert order.peek(run_dir) == 2


@pytest.mark.parametrize("engine, module", rank_module.ENGINE_WORLDS)
def test_an_engines_world_group_names_the_rank_and_local_rank(monkeypatch, engine, module):
    # vLLM 0.32 and SGLang 0.5.23 keep `_WORLD`, a GroupCoordinator with `rank` and `local_rank` (SGLang: the
    # scheduler's gpu_id; tests/hook/test_presets_sglang.py checks that in its source).
    state = types.ModuleType(module)
    state._WORLD = types.SimpleNamespace(rank=5, local_rank=1)
    for _, other in rank_module.ENGINE_WORLDS:
        monkeypatch.delitem(sys.modules, other, raising=False)
    monkeypatch.setitem(sys.modules, module, state)
    assert resolve_rank({"RANK": "9", "LOCAL_RANK": "7"}) == RankInfo(5, 1, engine)
