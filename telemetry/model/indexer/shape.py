"""The indexer workload as one value: `IndexerShape`, validated once, and the reference workload.

Every command that runs the sparse indexer's allocation pattern (`memtel replay`, `memtel lab serve`,
`memtel demo`, the demo's prediction, the truth capture, the benchmarks) takes its shape from here,
and its argparse defaults from `REFERENCE_SHAPE`.

The logits budget has one name and one unit: `logits_budget_bytes`, an integer. Command lines take it
in MiB (`--budget-mb`, vLLM's `VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`) as a number that may have a
fraction; `budget_bytes_from_mib` converts it exactly once, rounding down to whole bytes
(`floor(MiB × 1,048,576)`), and `budget_mib_text` writes bytes back as a MiB number that converts to the
same bytes (so a shape passed on a command line to another process arrives unchanged).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from telemetry import limits
from telemetry.argtypes import bounded_int
from telemetry.errors import ConfigError

FLOAT32_BYTES = 4
MIB = 1024 * 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The largest value of each field (telemetry/limits.py; docs/lab.md "Limits").
SHAPE_MAXIMA = {"layers": limits.MAX_LAYERS, "chunk": limits.MAX_MODEL_LEN, "compress_ratio": limits.MAX_COMPRESS_RATIO,
                "max_model_len": limits.MAX_MODEL_LEN}
MAX_BUDGET_BYTES = int(limits.MAX_BUDGET_MIB * MIB)


class ShapeError(ConfigError):
    """An indexer shape that cannot be run; the message names the field and what is expected."""


@dataclass(frozen=True)
class IndexerShape:
    """The sparse indexer's prefill workload (defaults: the reference workload of the user's A/B profile).

    layers: indexer layers a chunk step runs through (each makes the step's launches).
    chunk: prefill chunk in tokens (vLLM's max-num-batched-tokens).
    compress_ratio: tokens per compressed kv entry; the kv length is ``tokens_so_far // compress_ratio``.
    max_model_len: the context limit; it sets the fixed mode's width.
    logits_budget_bytes: the most logits bytes one launch may hold (512 MiB: vLLM's default).
    fixed_width: the fixed mode's width; None: ``ceil(max_model_len / compress_ratio)``.
    topk: top-k outputs allocated per launch (values float32 and indices int64, ``[rows, topk]``); 0: none.
    """

    layers: int = 45
    chunk: int = 8192
    compress_ratio: int = 4
    max_model_len: int = 204_800
    logits_budget_bytes: int = 512 * MIB
    fixed_width: int | None = None
    topk: int = 0

    def __post_init__(self) -> None:
        problems = []
        for name in ("layers", "chunk", "compress_ratio", "max_model_len"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
            elif value > SHAPE_MAXIMA[name]:
                problems.append(f"{name} must be at most {SHAPE_MAXIMA[name]:,}, got {value:,}")
        budget = self.logits_budget_bytes
        if not _is_int(budget) or budget < FLOAT32_BYTES:
            problems.append(f"logits_budget_bytes must be an integer >= {FLOAT32_BYTES} (one float32), got {budget!r}")
        elif budget > MAX_BUDGET_BYTES:
            problems.append(f"logits_budget_bytes must be at most {MAX_BUDGET_BYTES:,} (1 TiB), got {budget:,}")
        if self.fixed_width is not None and (not _is_int(self.fixed_width) or self.fixed_width < 1):
            problems.append(f"fixed_width must be a positive integer or None, got {self.fixed_width!r}")
        elif self.fixed_width is not None and self.fixed_width > limits.MAX_MODEL_LEN:
            problems.append(f"fixed_width must be at most {limits.MAX_MODEL_LEN:,}, got {self.fixed_width:,}")
        if not _is_int(self.topk) or self.topk < 0:
            problems.append(f"topk must be an integer >= 0, got {self.topk!r}")
        elif self.topk > limits.MAX_TOPK:
            problems.append(f"topk must be at most {limits.MAX_TOPK:,}, got {self.topk:,}")
        if problems:
            raise ShapeError("indexer shape: " + "; ".join(problems))

    @property
    def budget_elems(self) -> int:
        """Float32 logits elements one launch may hold."""
        return self.logits_budget_bytes // FLOAT32_BYTES

    @property
    def padded_width(self) -> int:
        """The fixed mode's width floor: `fixed_width`, else ``ceil(max_model_len / compress_ratio)``."""
        if self.fixed_width is not None:
            return self.fixed_width
        return math.ceil(self.max_model_len / self.compress_ratio)

    @property
    def logits_budget_mib(self) -> float:
        return self.logits_budget_bytes / MIB

    def as_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)


REFERENCE_SHAPE = IndexerShape()
"""45 layers, 8,192-token chunks, compress ratio 4, max-model-len 204,800, a 512 MiB logits budget."""


# --- the budget on command lines ----------------------------------------------------------------


def budget_bytes_from_mib(mib: float) -> int:
    """A logits budget given in MiB as bytes: ``floor(mib × 1,048,576)``; ShapeError unless one float32 fits."""
    if not isinstance(mib, (int, float)) or isinstance(mib, bool) or not math.isfinite(mib):
        raise ShapeError(f"the logits budget must be a finite number of MiB, got {mib!r}")
    if mib > limits.MAX_BUDGET_MIB:
        raise ShapeError(f"the logits budget must be at most {limits.MAX_BUDGET_MIB:,.0f} MiB, got {mib!r} MiB")
    nbytes = math.floor(mib * MIB)
    if nbytes < FLOAT32_BYTES:
        raise ShapeError(f"the logits budget must hold at least one float32 ({FLOAT32_BYTES} bytes), got {mib!r} MiB")
    return nbytes


def budget_mib_text(nbytes: int) -> str:
    """`nbytes` as a MiB number for a command line; `budget_bytes_from_mib` of it is `nbytes` again.

    Dividing by a power of two is exact in floating point, so repr() round-trips; whole MiB read as such.
    """
    mib = nbytes / MIB
    return str(int(mib)) if mib.is_integer() else repr(mib)


def _budget_mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB such as 512 or 96.5, got {text!r}") from None
    try:
        budget_bytes_from_mib(value)
    except ShapeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_shape_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, fixed_width: bool = False,
                        topk: bool = False) -> None:
    """The shape's flags, with `REFERENCE_SHAPE`'s values as defaults (`--fixed-width`, `--topk` if asked)."""
    ref = REFERENCE_SHAPE
    parser.add_argument("--layers", type=bounded_int(1, limits.MAX_LAYERS), default=ref.layers,
                        help=f"indexer layers per chunk step (default {ref.layers})")
    parser.add_argument("--chunk", type=bounded_int(1, limits.MAX_MODEL_LEN), default=ref.chunk,
                        help=f"prefill chunk in tokens (max-num-batched-tokens; default {ref.chunk})")
    parser.add_argument("--max-model-len", type=bounded_int(1, limits.MAX_MODEL_LEN), default=ref.max_model_len,
                        help=f"context limit in tokens; the fixed width is ceil(max-model-len / compress-ratio) "
                             f"(default {ref.max_model_len})")
    parser.add_argument("--compress-ratio", type=bounded_int(1, limits.MAX_COMPRESS_RATIO), default=ref.compress_ratio,
                        help=f"tokens per compressed kv entry (default {ref.compress_ratio})")
    parser.add_argument("--budget-mb", type=_budget_mib, default=ref.logits_budget_mib,
                        help=f"logits budget per launch in MiB (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB; default "
                             f"{budget_mib_text(ref.logits_budget_bytes)}); a fraction is allowed and rounded down "
                             f"to whole bytes")
    if fixed_width:
        parser.add_argument("--fixed-width", type=bounded_int(1, limits.MAX_MODEL_LEN), default=None,
                            help="the fixed mode's width (overrides ceil(max-model-len / compress-ratio))")
    if topk:
        parser.add_argument("--topk", type=bounded_int(0, limits.MAX_TOPK), default=ref.topk,
                            help="allocate top-k outputs (values f32 + indices i64, [rows, K]) per launch (default 0)")


def shape_from_args(args: argparse.Namespace) -> IndexerShape:
    """The shape of parsed `add_shape_arguments` flags (the budget converted here, once)."""
    return IndexerShape(layers=args.layers, chunk=args.chunk, compress_ratio=args.compress_ratio,
                        max_model_len=args.max_model_len, logits_budget_bytes=budget_bytes_from_mib(args.budget_mb),
                        fixed_width=getattr(args, "fixed_width", None), topk=getattr(args, "topk", 0))


def shape_arguments(shape: IndexerShape) -> list[str]:
    """Command-line flags that give another `memtel` command exactly this shape (not --fixed-width/--topk)."""
    return ["--layers", str(shape.layers), "--chunk", str(shape.chunk), "--max-model-len", str(shape.max_model_len),
            "--compress-ratio", str(shape.compress_ratio), "--budget-mb", budget_mib_text(shape.logits_budget_bytes)]


__all__ = ["FLOAT32_BYTES", "MIB", "REFERENCE_SHAPE", "IndexerShape", "ShapeError", "add_shape_arguments",
           "budget_bytes_from_mib", "budget_mib_text", "shape_arguments", "shape_from_args"]
