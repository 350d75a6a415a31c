"""`memtel tune` after a restart, on a GPU: one messy allocation history run for real under several settings, each
setting's real edge against the prediction from the defaults' snapshot plus that history (issue 37, item 5).

    PYTHONPATH=. python3 benchmarks/tune_history_gpu.py --out DIR [--fraction 0.09] [--settings base,expandable,...]
                                                       [--deadline-s 540]
    PYTHONPATH=. python3 benchmarks/tune_history_gpu.py --out DIR --history FILE --probe N,N,...

Needs CUDA (torch with a GPU). Run on the H200: BENCHMARKS.md; its capture is tests/fixtures/tune-history.

1. The history (`history_ops`, seeded): 12 resident tensors, 240 mixed small and large tensors of which 120 are
   freed in random order, eight 256 MiB KV blocks, a warm 32,768-token indexer prefill of SHAPE.
2. Per setting (`SETTINGS`: the defaults, expandable segments, max_split_size_mb:256, a GC threshold), a fresh
   process sets `torch.cuda.set_per_process_memory_fraction(--fraction)` and PYTORCH_CUDA_ALLOC_CONF, runs the
   history (every allocation and free recorded as ops, the prefill's too) and records its snapshot.
3. The prediction: from the defaults' snapshot and history, `memtel tune`'s replay (telemetry/model/fitsearch) of each
   setting under the same fraction (`--cap fraction`).
4. The real edge: fresh processes (one per length) run the history then a prefill of N tokens; the prediction and
   the token after it first, then a walk and a bisection until the longest length that fits and the first that
   runs out of memory are one token apart (or the deadline). The probe of the first misfit records the sizes of
   its last chunk step's allocations (`last_step_bytes`) and the allocator's own trace of them (`trace_tail`):
   whether the edge moved with a size the model does not have (the defaults were one token over on
   shared/data/tune-truth, whose capture script is not in the repo; this one launches as the model does).

Writes DIR/tune-history.json after each setting and prints a table: predicted against real per setting.

With `--history FILE --probe N,...` (shared/data/tune-truth's history file, which ends with its own warm prefill):
only those lengths, under the defaults, each with its last step's sizes and the allocator's trace, to DIR/probe.json.
That is the one-token question in tests/tune/test_tune_history.py asked of a process that launches as the model does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
SETTINGS = {"base": "", "expandable": "expandable_segments:True", "split256": "max_split_size_mb:256",
            "gc06": "garbage_collection_threshold:0.6"}
SHAPE = {"layers": 4, "chunk": 8192, "compress_ratio": 4, "max_model_len": 1 << 20,
         "logits_budget_bytes": 2048 * MIB, "topk": 2048}
WARM_TOKENS = 32_768


def history_ops(seed: int = 37) -> list[list[Any]]:
    """The history before the warm prefill, as ops (the prefill's own are recorded as it runs)."""
    rnd = random.Random(seed)
    ops: list[list[Any]] = []
    ident = 0

    def alloc(nbytes: int) -> int:
        nonlocal ident
        ident += 1
        ops.append(["a", ident, nbytes])
        return ident

    for _ in range(12):
        alloc(rnd.randrange(50, 700) * MIB + rnd.randrange(0, MIB))
    mixed = [alloc(rnd.choice((rnd.randrange(512, MIB), rnd.randrange(2, 60) * MIB + rnd.randrange(0, MIB))))
             for _ in range(240)]
    rnd.shuffle(mixed)
    for key in mixed[:120]:
        ops.append(["f", key])
    for _ in range(8):
        alloc(256 * MIB)
    return ops


class Recording:
    """A backend that records every allocation and free as ops (and the sizes of the last `keep` allocations)."""

    def __init__(self, inner: Any, ops: list[list[Any]], first_id: int) -> None:
        self.inner, self.ops, self.next = inner, ops, first_id
        self.handles: dict[int, Any] = {}
        self.sizes: list[int] = []
        self.name = inner.name

    def _keep(self, allocation: Any, nbytes: int) -> int:
        self.next += 1
        self.handles[self.next] = allocation
        self.ops.append(["a", self.next, nbytes])
        self.sizes.append(nbytes)
        return self.next

    def alloc(self, nbytes: int) -> int:
        return self._keep(self.inner.alloc(nbytes), nbytes)

    def launch(self, rows: int, width: int, kv_len: int) -> int:
        return self._keep(self.inner.launch(rows, width, kv_len), rows * width * 4)

    def release(self, key: Any) -> None:
        self.ops.append(["f", key])
        self.inner.release(self.handles.pop(key))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def child(fraction: float, tokens: int, sim: bool = False, history: Path | None = None) -> dict[str, Any]:
    """In a fresh process: the history, then (tokens > 0) a prefill of `tokens`. sim: the lab's simulator stands
    for CUDA (a dry run of this script on a machine without a GPU; its figures agree by construction). history: a
    history file of ops that ends with its own warm prefill (shared/data/tune-truth's), instead of `history_ops`."""
    from telemetry.model.allocsim.simulator import DEFAULT_TOTAL_MEMORY, SimulatedOutOfMemoryError
    from telemetry.model.indexer.backends import SimBackend
    from telemetry.model.indexer.prefill import run_prefill
    from telemetry.model.indexer.shape import IndexerShape

    shape = IndexerShape(**SHAPE)
    ops = json.loads(history.read_text()) if history is not None else history_ops()
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if sim:
        inner: Any = SimBackend(",".join(p for p in (conf, f"per_process_memory_fraction:{fraction}") if p))
        out_of_memory: Any = SimulatedOutOfMemoryError
        out: dict[str, Any] = {"conf": conf, "fraction": fraction, "total_memory": DEFAULT_TOTAL_MEMORY,
                               "device": "simulator", "torch": None}
    else:
        import torch

        from telemetry.model.indexer.backends import CudaBackend

        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        inner = CudaBackend(0)
        out_of_memory = torch.cuda.OutOfMemoryError
        total = int(torch.cuda.get_device_properties(0).total_memory)
        out = {"conf": conf, "fraction": fraction, "total_memory": total, "device": torch.cuda.get_device_name(0),
               "torch": torch.__version__}
    backend = Recording(inner, [], 0)
    live: dict[int, Any] = {}
    for op in ops:   # the history's own ids, replayed in order
        if op[0] == "a":
            live[op[1]] = backend.inner.alloc(op[2])
        else:
            backend.inner.release(live.pop(op[1]))
    backend.ops = [list(op) for op in ops]
    backend.next = max(op[1] for op in ops)
    if history is None:
        run_prefill(backend, shape, "stock", WARM_TOKENS)
    inner.finish()
    if tokens == 0:
        if sim:
            segments = inner.snapshot()
        else:
            from telemetry.hook.allocator import cuda_memory_snapshot

            segments = cuda_memory_snapshot(torch)
        out.update(snapshot=segments, history=backend.ops, reserved=int(inner.counters().reserved_bytes))
        return out
    backend.sizes = []
    if not sim:   # every allocation the prefill makes, the allocator's own view (anything the model lacks shows)
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=100_000)
    try:
        run_prefill(backend, shape, "stock", tokens)
        inner.finish()
        out["fits"] = True
    except out_of_memory:
        out["fits"] = False
    out["last_step_bytes"] = backend.sizes[-shape.layers * 3:]   # per layer: the logits, the top-k values, indices
    if not sim:
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        out["trace_tail"] = [[e["action"], e["size"]] for e in trace[-60:] if e["action"] in
                             ("alloc", "free_completed", "segment_alloc", "segment_free", "oom")]
    return out


SIM = False   # --dry-run-sim


def run_child(conf: str, fraction: float, tokens: int, history: Path | None = None) -> dict[str, Any]:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, __file__, "--child", str(tokens), "--fraction", repr(fraction),
                           *(["--dry-run-sim"] if SIM else []), *(["--history", str(history)] if history else [])],
                          capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"child ({conf!r}, {tokens}) failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.splitlines()[-1]))


def predict(base: dict[str, Any], conf: str) -> int:
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.fitsearch.history import check_matches, history_from_ops
    from telemetry.model.fitsearch.search import Problem, evaluate
    from telemetry.model.fitsearch.space import Setting
    from telemetry.model.indexer.prefill import LaunchPattern
    from telemetry.model.indexer.shape import IndexerShape

    state = read_allocator_state(base["snapshot"])
    history = history_from_ops(base["history"])
    check_matches(history, state, "")
    shape = IndexerShape(**SHAPE)
    problem = Problem(state, shape, int(base["total_memory"] * base["fraction"]), 131_072, LaunchPattern(),
                      total_memory=base["total_memory"], cap="fraction", history=history, process_conf="")
    outcome = evaluate(problem, Setting(conf, shape.logits_budget_bytes, shape.chunk, "stock"))
    assert outcome.fit is not None
    return int(outcome.fit.tokens)


def real_edge(conf: str, fraction: float, guess: int, deadline: float) -> dict[str, Any]:
    tried: dict[int, dict[str, Any]] = {}

    def fits(n: int) -> bool:
        if n not in tried:
            tried[n] = run_child(conf, fraction, n)
        return bool(tried[n]["fits"])

    top = SHAPE["max_model_len"]
    good, bad = (guess, None) if fits(guess) else (None, guess)
    step = 4096
    while good is None and time.monotonic() < deadline:   # walk down to a length that fits
        n = max(1, (bad or guess) - step)
        good, bad = (n, bad) if fits(n) else (None, n)
        step *= 2
    while bad is None and good is not None and good < top and time.monotonic() < deadline:
        n = min(top, good + (1 if good == guess else step))
        good, bad = (n, None) if fits(n) else (good, n)
        step *= 2
    while good is not None and bad is not None and bad - good > 1 and time.monotonic() < deadline:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    exact = good is not None and ((bad is None and good == top) or (bad is not None and bad - good == 1))
    return {"longest_fit": good, "first_oom": bad, "exact": exact,
            "last_step_bytes_at_first_oom": None if bad is None else tried[bad]["last_step_bytes"],
            "trace_tail_at_first_oom": None if bad is None else tried[bad].get("trace_tail"),
            "probes": len(tried)}


def probe(out: Path, history: Path, fraction: float, lengths: list[int]) -> int:
    """Each length run for real after `history` (under the defaults): whether it fits, its last chunk step's
    sizes and the allocator's own trace; written to OUT/probe.json as each arrives."""
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"history": history.name, "fraction": fraction, "shape": SHAPE, "probes": {}}
    for tokens in lengths:
        doc["probes"][str(tokens)] = run_child("", fraction, tokens, history)
        (out / "probe.json").write_text(json.dumps(doc))
        print(f"{tokens:>10,}  {'fits' if doc['probes'][str(tokens)]['fits'] else 'out of memory'}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--fraction", type=float, default=0.09)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--deadline-s", type=float, default=540.0)
    parser.add_argument("--dry-run-sim", action="store_true",
                        help="the lab's simulator instead of CUDA: checks this script end to end without a GPU")
    parser.add_argument("--history", type=Path, default=None,
                        help="a history file of ops ending with its warm prefill (with --probe)")
    parser.add_argument("--probe", default=None,
                        help="with --history: only these prefill lengths (comma-separated), under the defaults, "
                             "each with its last chunk step's sizes and the allocator's trace")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.fraction, args.child, args.dry_run_sim, args.history)))
        return 0
    global SIM
    SIM = args.dry_run_sim
    if args.out is None:
        parser.error("--out DIR is required")
    if (args.history is None) != (args.probe is None):
        parser.error("--history and --probe go together")
    if args.probe is not None:
        try:
            ops = json.loads(args.history.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as error:
            parser.error(f"--history {args.history}: {error} (expected a JSON list of ops)")
        if not isinstance(ops, list) or not ops:
            parser.error(f"--history {args.history}: expected a JSON list of ops, [\"a\", id, bytes] or [\"f\", id]")
        try:
            lengths = [int(n) for n in args.probe.split(",")]
        except ValueError:
            lengths = []
        if not lengths or min(lengths) < 1:
            parser.error(f"--probe {args.probe!r}: expected prefill lengths, positive integers separated by commas")
        return probe(args.out, args.history, args.fraction, lengths)
    deadline = time.monotonic() + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    base = run_child("", args.fraction, 0)
    doc: dict[str, Any] = {"fraction": args.fraction, "shape": SHAPE, "base": base, "settings": {}}
    print(f"{'setting':<12} {'predicted':>10} {'real fit':>10} {'first OOM':>10}  agrees")
    for name in args.settings.split(","):
        conf = SETTINGS[name]
        own = base if not conf else run_child(conf, args.fraction, 0)
        predicted = predict(base, conf)
        real = real_edge(conf, args.fraction, predicted, deadline)
        agrees = real["exact"] and real["longest_fit"] == predicted
        doc["settings"][name] = {"conf": conf, "predicted": predicted, "own_reserved": own["reserved"], **real}
        (args.out / "tune-history.json").write_text(json.dumps(doc))
        print(f"{name:<12} {predicted:>10,} {real['longest_fit'] or 0:>10,} {real['first_oom'] or 0:>10,}  "
              f"{'yes' if agrees else 'NO'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
