"""What `memtel tune` searches: one `Setting` (allocator settings, logits budget, chunk, width mode) and the
`SearchSpace` of them, each value checked the way torch's allocator-config parser and the engine check it.

A setting's allocator part is written as a `PYTORCH_CUDA_ALLOC_CONF` string and parsed back with
`telemetry.model.allocsim.config.parse_alloc_conf` (torch 2.11's rules: `max_split_size_mb` at least 20,
`roundup_power2_divisions` a power of two, `garbage_collection_threshold` in (0, 1)), so a string torch would
reject is never produced. Settings of the process that the search does not vary (`per_process_memory_fraction`,
`max_non_split_rounding_mb`) are kept as the process has them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from telemetry.errors import ConfigError
from telemetry.model.allocsim.config import MIN_SPLIT_MB, AllocatorConfig, format_alloc_conf, parse_alloc_conf
from telemetry.model.indexer.planner import MODES, Mode, check_mode
from telemetry.model.indexer.shape import MIB, IndexerShape, budget_mib_text


class SearchSpaceError(ConfigError):
    """A search space that holds no setting to try, or a value torch or the engine would reject."""


@dataclass(frozen=True)
class Setting:
    """One point of the search: the allocator settings and the indexer's knobs.

    alloc_conf: the full `PYTORCH_CUDA_ALLOC_CONF` string (parsed: torch accepts it); budget_bytes: the logits
    budget; chunk: the prefill chunk (max-num-batched-tokens); mode: stock or fixed logits width.
    """

    alloc_conf: str
    budget_bytes: int
    chunk: int
    mode: Mode

    def shape(self, base: IndexerShape) -> IndexerShape:
        return dataclasses.replace(base, logits_budget_bytes=self.budget_bytes, chunk=self.chunk)

    def label(self) -> str:
        conf = self.alloc_conf or "defaults"
        return f"{conf}; budget {budget_mib_text(self.budget_bytes)} MiB; chunk {self.chunk:,}; {self.mode}"

    def as_json(self) -> dict[str, object]:
        return {"alloc_conf": self.alloc_conf, "logits_budget_bytes": self.budget_bytes,
                "logits_budget_mib": self.budget_bytes / MIB, "chunk": self.chunk, "mode": self.mode}


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class SearchSpace:
    """The values tried per knob; None means "not set" (torch's default). `budgets_bytes` and `chunks` None:
    the process's own value only."""

    expandable_segments: tuple[bool, ...] = (False, True)
    max_split_size_mb: tuple[int | None, ...] = (None, 128, 512)
    roundup_power2_divisions: tuple[int | None, ...] = (None, 2, 8)
    garbage_collection_threshold: tuple[float | None, ...] = (None, 0.6, 0.8)
    budgets_bytes: tuple[int, ...] | None = tuple(n * MIB for n in (128, 256, 512, 1024, 2048))
    chunks: tuple[int, ...] | None = (2048, 4096, 8192, 16384)
    modes: tuple[str, ...] = MODES

    def check(self) -> None:
        """SearchSpaceError naming every value torch or the planner would reject."""
        problems = []
        for mb in self.max_split_size_mb:
            if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < MIN_SPLIT_MB):
                problems.append(f"max_split_size_mb {mb!r} (torch needs an integer of at least {MIN_SPLIT_MB})")
        for n in self.roundup_power2_divisions:
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not _power_of_two(n)):
                problems.append(f"roundup_power2_divisions {n!r} (torch needs a power of two)")
        for t in self.garbage_collection_threshold:
            if t is not None and not (isinstance(t, float) and 0.0 < t < 1.0):
                problems.append(f"garbage_collection_threshold {t!r} (torch needs a number in (0, 1))")
        for mode in self.modes:
            if mode not in MODES:
                problems.append(f"mode {mode!r} (expected {' or '.join(MODES)})")
        for name, values in (("budget", self.budgets_bytes), ("chunk", self.chunks)):
            if values is not None and not values:
                problems.append(f"an empty {name} list")
        if not self.modes:
            problems.append("an empty mode list")
        if problems:
            raise SearchSpaceError("search space: " + "; ".join(problems))


@dataclass(frozen=True)
class Expanded:
    """The settings of a space for one process, and what was left out and why (one line each)."""

    settings: tuple[Setting, ...]
    left_out: tuple[str, ...]


def alloc_confs(space: SearchSpace, process: AllocatorConfig, *,
                fraction_applies: bool = False) -> tuple[list[str], list[str]]:
    """The distinct allocator settings of `space` over the process's (`process`), and notes on what is left out.

    garbage_collection_threshold acts only under a memory fraction (torch: `set_fraction`, the simulator's
    `_gc`): the process's own, or the one the search's cap sets (`fraction_applies`: `--cap fraction`). Without
    one it is not searched: every threshold would give the defaults' answer.
    """
    notes = []
    thresholds = space.garbage_collection_threshold
    fraction = process.per_process_memory_fraction is not None or fraction_applies
    if not fraction and any(t is not None for t in thresholds):
        notes.append("garbage_collection_threshold not searched: torch applies it only under "
                     "per_process_memory_fraction, which this process does not set (--cap fraction sets one)")
        thresholds = (None,)
    seen: dict[AllocatorConfig, str] = {}
    for expandable in space.expandable_segments:
        for split in space.max_split_size_mb:
            for divisions in space.roundup_power2_divisions:
                for threshold in thresholds:
                    config = dataclasses.replace(
                        process, source="", expandable_segments=expandable,
                        max_split_size=AllocatorConfig.max_split_size if split is None else split * MIB,
                        roundup_power2_divisions=(divisions or 0,) * len(process.roundup_power2_divisions),
                        garbage_collection_threshold=threshold or 0.0)
                    text = format_alloc_conf(config)
                    parsed = parse_alloc_conf(text)   # torch's rules; raises for a string torch would reject
                    key = dataclasses.replace(parsed, source="")
                    seen.setdefault(key, text)
    return list(seen.values()), notes


def expand(space: SearchSpace, base: IndexerShape, process_conf: str, *, engine_modes: tuple[str, ...] = MODES,
           engine_name: str = "the engine", fraction_applies: bool = False) -> Expanded:
    """Every setting of `space` for a process with `base`'s shape and allocator settings `process_conf`.

    engine_modes: the width modes the engine can run (SGLang has no fixed-width switch); fraction_applies: a
    memory fraction caps the process (`--cap fraction`), so garbage_collection_threshold acts. SearchSpaceError when
    nothing is left, naming why.
    """
    space.check()
    process = parse_alloc_conf(process_conf)
    confs, notes = alloc_confs(space, process, fraction_applies=fraction_applies)
    budgets = space.budgets_bytes if space.budgets_bytes is not None else (base.logits_budget_bytes,)
    chunks = space.chunks if space.chunks is not None else (base.chunk,)
    modes = [m for m in dict.fromkeys(space.modes) if m in engine_modes]
    dropped_modes = [m for m in space.modes if m not in engine_modes]
    why: list[str] = []
    if dropped_modes:
        line = f"mode {', '.join(dropped_modes)}: {engine_name} has no switch for it"
        (notes if modes else why).append(line)
    usable_chunks = sorted({c for c in chunks if 1 <= c <= base.max_model_len})
    if len(usable_chunks) < len(set(chunks)):
        line = (f"chunks above max-model-len {base.max_model_len:,} left out: "
                + ", ".join(f"{c:,}" for c in sorted(set(chunks) - set(usable_chunks))))
        (notes if usable_chunks else why).append(line)
    usable_budgets = sorted(set(budgets))
    if why:
        raise SearchSpaceError("no setting to search: " + "; ".join(why))
    settings = tuple(Setting(conf, budget, chunk, check_mode(mode))
                     for mode in modes for chunk in usable_chunks for budget in usable_budgets for conf in confs)
    for setting in settings:   # every shape must be valid before any is simulated
        setting.shape(base)
    return Expanded(settings, tuple(notes))


def process_setting(base: IndexerShape, process_conf: str, mode: str) -> Setting:
    """The process's own setting (what it runs today): the comparison every ranking shows."""
    parse_alloc_conf(process_conf)
    return Setting(process_conf, base.logits_budget_bytes, base.chunk, check_mode(mode))


def iter_values(text: str) -> Iterator[str]:
    for part in text.split(","):
        part = part.strip()
        if part:
            yield part


__all__ = ["Expanded", "SearchSpace", "SearchSpaceError", "Setting", "alloc_confs", "expand", "iter_values",
           "process_setting"]
