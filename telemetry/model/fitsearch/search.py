"""The search of `memtel tune`: every setting of a space, ranked by the longest prefill that fits a memory limit,
from one allocator state, on the simulator (`telemetry.model.indexer.fit.max_prefill_tokens`).

Rank: the longest prefill that fits (every shorter one fitting too), then fewer launches per prefill of the
target length (the cost of a smaller budget or chunk), then the lower peak reserved at the target, then fewer
device allocations. Only the top `top` settings (and the process's own) need their exact answer, so:

1. settings that behave alike are simulated once: allocator settings that parse to the same configuration, and
   logits budgets that split no launch of the longest prefill (every such budget gives the same launches);
2. screen: one simulated prefill of max-model-len tokens per setting bounds its fit from above (where it runs
   out of memory, no longer prefill fits; fit.py); a setting whose first launch cannot fit beside the live bytes
   is bounded by 0 without simulating;
3. branch and bound: settings are searched in full in the order of their bounds (cheapest first among equal
   bounds); once the top is full, a setting whose bound is below the top's last fit (or equal to it, with more
   launches) cannot enter it and is not searched; one that ties it on fit and launches is searched only if its
   target-length peak is lower. Settings whose screen reaches max-model-len are searched first, fewest launches
   first, and once the top is full of such settings the rest with more launches are ruled out without a screen
   (no fit exceeds max-model-len; `tune`);
4. inside one setting, `max_prefill_tokens` bisects on the length (fit.py: one long prefill answers every chunk
   boundary; a search inside the classes of the last chunk).

Not searched: `max_non_split_rounding_mb`, `per_process_memory_fraction` and the allocator backend (kept as the
process has them), private memory pools, CUDA graphs, the engine's other activations (a larger chunk also
grows the model's own activations, which the indexer model does not hold), KV-cache size per token.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from telemetry.errors import ConfigError
from telemetry.model.allocsim.cap import CAPS, capped
from telemetry.model.allocsim.config import parse_alloc_conf
from telemetry.model.allocsim.snapshot import AllocatorState
from telemetry.model.fitsearch.history import History, SimulatedOutOfMemoryError, replay
from telemetry.model.fitsearch.space import Expanded, Setting
from telemetry.model.indexer.fit import MaxFit, max_prefill_tokens
from telemetry.model.indexer.forecast import Forecast, simulate_prefill
from telemetry.model.indexer.planner import check_mode, plan_prefill
from telemetry.model.indexer.prefill import LaunchPattern
from telemetry.model.indexer.shape import FLOAT32_BYTES, MAX_BUDGET_BYTES, IndexerShape

DEFAULT_TOP = 5


@dataclass(frozen=True)
class Problem:
    """What is searched: the state, the process's shape, the memory limit and the target length.

    limit_bytes: what the allocator may reserve in all (the simulator's capacity); total_memory: the device's
    total (a memory fraction's base; None: unknown); release_cache_on_oom: False where the limit is a share of
    a node the allocator does not see (fit.py); cap: how the limit stops the allocator. "device": the memory
    runs out (cudaMalloc fails, or cuMemCreate for an expandable segment's pages: the pages mapped count);
    "fraction": torch's per-process memory fraction (`set_per_process_memory_fraction`, what `--verify` on CUDA
    sets), checked before each new segment against the request's segment size, not the pages an expandable
    segment maps for it.
    """

    state: AllocatorState
    base: IndexerShape
    limit_bytes: int
    target_tokens: int
    pattern: LaunchPattern = field(default_factory=LaunchPattern)
    total_memory: int | None = None
    release_cache_on_oom: bool = True
    cap: str = "device"
    history: History | None = None
    process_conf: str = ""
    _states: dict[str, AllocatorState | None] = field(default_factory=dict, init=False, compare=False, repr=False,
                                                      hash=False)

    def same_layout(self, setting: Setting) -> bool:
        """Whether `setting` runs the process's own allocator settings (the snapshot is its state as it is)."""
        return same_conf(setting.alloc_conf, self.process_conf)

    def state_for(self, setting: Setting) -> AllocatorState | None:
        """The state a process restarted under `setting` has at the snapshot's moment: the snapshot for the
        process's own allocator settings; with a history, that history replayed under the setting (within the
        cap); without one, the snapshot (a best case for other settings: history.py). None where the history
        itself runs out of memory under the setting."""
        if self.history is None or self.same_layout(setting):
            return self.state
        conf, capacity, total = simulated_limit(self, setting.alloc_conf)
        if conf not in self._states:
            try:
                self._states[conf] = replay(self.history, conf, capacity_bytes=capacity, total_memory=total,
                                            device=self.state.device)
            except SimulatedOutOfMemoryError:
                self._states[conf] = None
        return self._states[conf]

    def __post_init__(self) -> None:
        if self.cap not in CAPS:
            raise ConfigError(f"the cap must be {' or '.join(CAPS)}, got {self.cap!r}")
        if self.cap == "fraction" and not self.release_cache_on_oom:
            raise ConfigError("a memory fraction is the allocator's own limit: it frees its cache before it runs "
                              "out, so it cannot stand for a share of a node")
        if self.cap == "fraction" and parse_alloc_conf(self.state.alloc_conf or "").per_process_memory_fraction:
            raise ConfigError("the snapshot's settings already set per_process_memory_fraction: give the memory as "
                              "--cap device, or the fraction's memory as the limit")
        if isinstance(self.target_tokens, bool) or not isinstance(self.target_tokens, int) or self.target_tokens < 1:
            raise ConfigError(f"the target length must be a positive number of tokens, got {self.target_tokens!r}")
        live = self.state.counters.allocated_bytes
        if isinstance(self.limit_bytes, bool) or not isinstance(self.limit_bytes, int):
            raise ConfigError(f"the memory limit must be a whole number of bytes, got {self.limit_bytes!r}")
        if self.limit_bytes < live:
            raise ConfigError(f"the memory limit ({self.limit_bytes:,} bytes) is below the state's live bytes "
                              f"({live:,} bytes = {live / 2**30:.2f} GiB): no prefill can fit; give more memory")
        if self.target_tokens > self.base.max_model_len:
            raise ConfigError(f"--target-tokens {self.target_tokens:,} is longer than max-model-len "
                              f"{self.base.max_model_len:,} (raise --max-model-len, or ask for a shorter target)")


@dataclass(frozen=True)
class Outcome:
    """One setting's answer. fit: its exact longest prefill (None when pruned); fit_at_most: the bound a pruned
    setting was shown to stay within; target: the forecast of a target-length prefill within the limit (None
    when pruned); launches: logits launches of a target-length prefill, all layers; same_as: the setting whose
    simulation this one shares (it behaves alike)."""

    setting: Setting
    launches: int
    fit: MaxFit | None = None
    fit_at_most: int | None = None
    target: Forecast | None = None
    pruned: str | None = None
    same_as: Setting | None = None
    best_case: bool = False   # from the snapshot alone under other allocator settings: at most this fit

    @property
    def fit_tokens(self) -> int:
        return self.fit.tokens if self.fit is not None else -1

    def rank_key(self) -> tuple[int, int, int, int]:
        peak = self.target.peak_reserved_bytes if self.target is not None else 2**63
        allocs = self.target.num_device_alloc if self.target is not None else 2**31
        return (-self.fit_tokens, self.launches, peak, allocs)

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"setting": self.setting.as_json(), "launches_per_prefill": self.launches,
                               "max_fit_tokens": self.fit.tokens if self.fit is not None else None,
                               "max_fit_at_most": self.fit_at_most, "pruned": self.pruned,
                               "best_case": self.best_case}
        if self.target is not None:
            doc.update(peak_reserved_bytes_at_target=self.target.peak_reserved_bytes,
                       peak_growth_bytes_at_target=self.target.peak_growth_bytes,
                       num_device_alloc_at_target=self.target.num_device_alloc,
                       target_out_of_memory=self.target.out_of_memory)
        if self.same_as is not None:
            doc["same_as"] = self.same_as.as_json()
        return doc


@dataclass(frozen=True)
class TuneResult:
    problem: Problem
    ranked: tuple[Outcome, ...]     # fully searched, best first
    pruned: tuple[Outcome, ...]     # ruled out of the top, with the bound they were shown to stay within
    process: Outcome                # the process's own setting (also in ranked when it made the top)
    left_out: tuple[str, ...]       # what the space left out and why
    settings: int                   # settings in the space
    simulations: int                # simulated prefills in all
    cpu_seconds: float
    notes: tuple[str, ...] = ()     # what the answer rests on that may not hold (history_check)

    @property
    def best(self) -> Outcome:
        return self.ranked[0]


class _Counter:
    def __init__(self) -> None:
        self.simulations = 0


def launches_per_prefill(shape: IndexerShape, mode: str, tokens: int) -> int:
    """Logits launches of a cold prefill of `tokens` (every layer)."""
    return shape.layers * sum(len(launches) for _, launches in plan_prefill(tokens, shape, check_mode(mode)))


def _largest_launch_bytes(shape: IndexerShape, mode: str, tokens: int,
                          pattern: LaunchPattern | None = None) -> int:
    """The largest logits launch of a cold prefill of `tokens`, in bytes (its rows scaled as `pattern` says)."""
    rows = (pattern or LaunchPattern()).rows
    return max((rows(launch.rows) * launch.width * FLOAT32_BYTES
                for _, launches in plan_prefill(tokens, shape, check_mode(mode))
                for launch in launches), default=0)


def _budget_key(shape: IndexerShape, mode: str) -> int:
    """The budget as far as it matters: a budget that splits no launch of the longest prefill acts as any
    larger one (the same launches at every length, since no shorter prefill has a larger launch)."""
    unsplit = dataclasses.replace(shape, logits_budget_bytes=MAX_BUDGET_BYTES)
    whole = _largest_launch_bytes(unsplit, mode, shape.max_model_len)
    return -1 if shape.logits_budget_bytes >= whole else shape.logits_budget_bytes


def _behaviour_key(problem: Problem, setting: Setting) -> tuple[Any, ...]:
    conf = dataclasses.replace(parse_alloc_conf(setting.alloc_conf), source="")
    shape = setting.shape(problem.base)
    return (conf, _budget_key(shape, setting.mode), setting.chunk, setting.mode)


def simulated_limit(problem: Problem, alloc_conf: str) -> tuple[str, int, int | None]:
    """(allocator settings, capacity bytes, total memory) that make the simulator stop where `problem`'s cap
    stops the allocator (telemetry/model/allocsim/cap.py)."""
    return capped(alloc_conf, problem.limit_bytes, problem.cap, problem.total_memory)


def same_conf(a: str, b: str) -> bool:
    """Whether two PYTORCH_CUDA_ALLOC_CONF strings set the same allocator."""
    return dataclasses.replace(parse_alloc_conf(a), source="") == dataclasses.replace(parse_alloc_conf(b), source="")


def _no_room(problem: Problem, setting: Setting, tokens: int) -> Forecast:
    """The forecast of a setting whose history itself runs out of memory: no prefill starts."""
    from telemetry.allocator_counters import AllocatorCounters

    start = AllocatorCounters(problem.limit_bytes, problem.state.counters.allocated_bytes, 0, 0)
    return Forecast(tokens=tokens, mode=setting.mode, alloc_conf=setting.alloc_conf, start=start,
                    reserved_growth_bytes=0, peak_reserved_bytes=problem.limit_bytes, peak_growth_bytes=0,
                    num_device_alloc=0, num_device_free=0, out_of_memory=True)


def _simulate(problem: Problem, setting: Setting, tokens: int, counter: _Counter) -> Forecast:
    state = problem.state_for(setting)
    if state is None:
        return _no_room(problem, setting, tokens)
    counter.simulations += 1
    conf, capacity, total = simulated_limit(problem, setting.alloc_conf)
    forecast, _ = simulate_prefill(state, setting.shape(problem.base), tokens, mode=setting.mode,
                                   alloc_conf=conf, pattern=problem.pattern, capacity_bytes=capacity,
                                   total_memory=total, release_cache_on_oom=problem.release_cache_on_oom)
    return forecast


def evaluate(problem: Problem, setting: Setting, counter: _Counter | None = None,
             target: Forecast | None = None) -> Outcome:
    """One setting searched in full: its longest fit and its target-length prefill (`target`: already simulated)."""
    counter = counter or _Counter()
    shape = setting.shape(problem.base)
    conf, capacity, total = simulated_limit(problem, setting.alloc_conf)
    state = problem.state_for(setting)
    launches = launches_per_prefill(shape, setting.mode, problem.target_tokens)
    if state is None:   # the history itself does not fit under this setting
        return Outcome(setting, launches, fit=MaxFit(0, shape.max_model_len, capacity, problem.limit_bytes,
                                                     problem.limit_bytes, 1, 0),
                       target=_no_room(problem, setting, problem.target_tokens))
    fit = max_prefill_tokens(state, shape, limit_bytes=capacity, mode=setting.mode, alloc_conf=conf,
                             pattern=problem.pattern, total_memory=total,
                             release_cache_on_oom=problem.release_cache_on_oom)
    counter.simulations += fit.simulations
    if target is None:
        target = _simulate(problem, setting, problem.target_tokens, counter)
    return Outcome(setting, launches, fit=fit, target=target)


def _upper_bound(problem: Problem, setting: Setting, counter: _Counter) -> int:
    """A bound its exact fit cannot exceed, from one simulated prefill of max-model-len tokens: where that one
    runs out of memory in a chunk step, no prefill that completes that step fits (fit.py, step 1)."""
    top = problem.base.max_model_len
    shape = setting.shape(problem.base)
    state = problem.state_for(setting)
    if state is None:
        return 0   # the history itself does not fit under this setting
    floor = state.counters.allocated_bytes + _largest_launch_bytes(shape, setting.mode, 1, problem.pattern)
    if floor > problem.limit_bytes:
        return 0   # not even the first launch of one token fits beside the live bytes
    counter.simulations += 1
    conf, capacity, total = simulated_limit(problem, setting.alloc_conf)
    forecast, watch = simulate_prefill(state, shape, top, mode=setting.mode, alloc_conf=conf,
                                       pattern=problem.pattern, capacity_bytes=capacity, total_memory=total,
                                       release_cache_on_oom=problem.release_cache_on_oom)
    if not forecast.out_of_memory:
        return top
    step = max(watch.step, 0)
    return min(step * shape.chunk + shape.chunk, top) - 1


def _dominated(bound: int, launches: int, last: Outcome | None) -> str | None:
    """Why a setting whose fit is at most `bound`, with `launches`, cannot enter a top whose last is `last`
    (None: it may). Its rank key is at least (-bound, launches); the top's last is (-last.fit, last.launches)."""
    if last is None:
        return None
    if bound < last.fit_tokens:
        return f"its longest fit is at most {bound:,} tokens (one prefill of max-model-len), below the top"
    if bound == last.fit_tokens and launches > last.launches:
        return (f"its longest fit is at most {bound:,} tokens, the top's last, with more launches per target "
                "prefill")
    return None


def tune(problem: Problem, expanded: Expanded, process: Setting, *, top: int = DEFAULT_TOP,
         progress: Callable[[int, int], None] | None = None) -> TuneResult:
    """Search `expanded`'s settings for `problem` (module docstring). `process` is the process's own setting,
    searched in full whatever its rank. progress(done, total) is called after each setting screened and each
    searched in full.

    Phase 1 walks the groups of alike settings in tiers of equal launches, fewest first: each group of a tier
    is screened; those whose bound is max-model-len get their target-length prefill and are searched in full
    in the order of its (peak, device allocations), the others wait. Once the top is full of settings that
    fit max-model-len, every group of a later tier is ruled out unscreened: no fit exceeds max-model-len, so
    its rank key (-fit, launches, ...) is above the top's last, whose launches are fewer. Within a tier, a
    group whose bound ties the last's fit is searched only if its (peak, device allocations) at the target is
    below the last's, the rest of the rank key. Phase 2 takes the waiting groups by their bounds, highest
    first, as step 3 of the module docstring says."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ConfigError(f"top must be a positive integer, got {top!r}")
    started = time.process_time()
    if problem.process_conf != process.alloc_conf:
        problem = dataclasses.replace(problem, process_conf=process.alloc_conf)
    counter = _Counter()
    target = problem.target_tokens
    longest = problem.base.max_model_len
    groups: dict[tuple[Any, ...], list[Setting]] = {}
    for setting in expanded.settings:
        groups.setdefault(_behaviour_key(problem, setting), []).append(setting)
    launches = {s: launches_per_prefill(s.shape(problem.base), s.mode, target) for s in expanded.settings}
    for members in groups.values():
        members.sort(key=lambda s: launches[s])
    total = len(groups) * 2
    done = 0
    ranked: list[Outcome] = []
    pruned: list[Outcome] = []

    def last() -> Outcome | None:
        return ranked[-1] if len(ranked) >= top else None

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    def settle(key: tuple[Any, ...], bound: int, probe: Forecast | None = None) -> None:
        members = groups[key]
        lead = members[0]
        why = _dominated(bound, launches[lead], last())
        end = last()
        if (why is None and end is not None and bound == end.fit_tokens and launches[lead] == end.launches
                and end.target is not None):
            probe = probe or _simulate(problem, lead, target, counter)   # ties on fit and launches: the peak
            if (probe.peak_reserved_bytes, probe.num_device_alloc) >= (end.target.peak_reserved_bytes,
                                                                       end.target.num_device_alloc):
                why = "ties the top's last on fit and launches at a peak and device allocations no lower"
        if why is not None:
            pruned.extend(Outcome(s, launches[s], fit_at_most=bound, pruned=why) for s in members)
        else:
            outcome = evaluate(problem, lead, counter, probe)
            ranked.extend([outcome] + [dataclasses.replace(outcome, setting=s, launches=launches[s], same_as=lead)
                                       for s in members[1:]])
            ranked.sort(key=Outcome.rank_key)
            while len(ranked) > top:
                pruned.append(dataclasses.replace(ranked.pop(), pruned="below the top"))
        tick()

    bounds: dict[tuple[Any, ...], int] = {}
    waiting: list[tuple[Any, ...]] = []
    tiers: dict[int, list[tuple[Any, ...]]] = {}
    for key in groups:
        tiers.setdefault(launches[groups[key][0]], []).append(key)
    for count in sorted(tiers):
        end = last()
        if end is not None and end.fit_tokens == longest and count > end.launches:
            why = (f"more launches per target prefill than the top's last ({end.launches:,}), whose fit is "
                   f"max-model-len, which no fit exceeds")
            for rest in (k for c in sorted(tiers) if c >= count for k in tiers[c]):
                pruned.extend(Outcome(s, launches[s], fit_at_most=longest, pruned=why) for s in groups[rest])
                tick()
                tick()
            break
        whole: list[tuple[Forecast, tuple[Any, ...]]] = []
        for key in tiers[count]:
            bounds[key] = _upper_bound(problem, groups[key][0], counter)
            tick()
            if bounds[key] == longest:
                whole.append((_simulate(problem, groups[key][0], target, counter), key))
            else:
                waiting.append(key)
        for probe, key in sorted(whole, key=lambda p: (p[0].peak_reserved_bytes, p[0].num_device_alloc)):
            settle(key, longest, probe)
    for key in sorted(waiting, key=lambda k: (-bounds[k], launches[groups[k][0]])):
        settle(key, bounds[key])
    mine = next((o for o in ranked if o.setting == process), None)
    if mine is None:   # today's setting, even outside the space, is ranked with the others (it may be the best)
        mine = evaluate(problem, process, counter)
        ranked = sorted([*ranked, mine], key=Outcome.rank_key)
        if len(ranked) > top:
            pruned.append(dataclasses.replace(ranked.pop(), pruned="below the top"))
    if problem.history is None:
        ranked = best_cases_after_today(problem, ranked, mine)
    check = history_check(problem, process)
    return TuneResult(problem, tuple(ranked), tuple(pruned), mine, expanded.left_out, len(expanded.settings),
                      counter.simulations, time.process_time() - started, () if check is None else (check,))


def history_check(problem: Problem, process: Setting) -> str | None:
    """Why the history may not be the whole story, or None: replayed under today's settings it must leave the
    snapshot's reserved bytes; where it does not, something the ops do not hold made the difference (an
    `empty_cache()`, allocations outside the history), and every setting's replay lacks it too."""
    if problem.history is None:
        return None
    conf, capacity, total = simulated_limit(problem, process.alloc_conf)
    want = problem.state.counters.reserved_bytes
    try:
        got = replay(problem.history, conf, capacity_bytes=capacity, total_memory=total,
                     device=problem.state.device).counters.reserved_bytes
    except SimulatedOutOfMemoryError:
        return "the history runs out of memory when replayed under today's settings: it is not this process's"
    if got == want:
        return None
    return (f"the history replayed under today's settings reserves {got:,} bytes, the snapshot {want:,}: something "
            "the ops do not hold (an empty_cache(), allocations outside the history) made the difference, and "
            "the other settings' replays lack it too")


def best_cases_after_today(problem: Problem, ranked: list[Outcome], mine: Outcome) -> list[Outcome]:
    """Without the process's history, a setting that changes the allocator's layout is searched from the
    snapshot's live blocks as they lie: a best case (the history may leave free memory trapped where that
    setting would put it). Such an outcome is marked, and never ranks above today's setting on that best case
    alone: it ranks as if it fit no more than today does, below today among equals."""
    marked = [dataclasses.replace(o, best_case=True) if o.fit is not None and not problem.same_layout(o.setting)
              else o for o in ranked]

    def key(o: Outcome) -> tuple[int, bool, tuple[int, int, int, int]]:
        fit = min(o.fit_tokens, mine.fit_tokens) if o.best_case else o.fit_tokens
        return (-fit, o.best_case, o.rank_key())

    return sorted(marked, key=key)


def suggest_utilization(outcome: Outcome, problem: Problem, current: float, total_memory: int) -> float | None:
    """The engine's memory share (vLLM's gpu_memory_utilization, SGLang's mem_fraction_static) that leaves a
    target-length prefill of `outcome`'s setting room within the limit: the current share plus what the limit
    leaves beyond the state once that prefill's peak growth is added, as a fraction of the device's total,
    rounded down to 0.01. Assumes the state's reserved memory is what the current share covers (a serving
    process at rest). None when the target prefill does not fit or the share would leave (0, 1]."""
    target = outcome.target
    if target is None or target.out_of_memory or total_memory <= 0:
        return None
    spare = problem.limit_bytes - problem.state.counters.reserved_bytes - target.peak_growth_bytes
    share = int((current + spare / total_memory) * 100) / 100
    return share if 0.0 < share <= 1.0 else None


__all__ = ["CAPS", "DEFAULT_TOP", "Outcome", "Problem", "TuneResult", "best_cases_after_today", "evaluate",
           "history_check",
           "launches_per_prefill", "same_conf", "simulated_limit", "suggest_utilization", "tune"]
