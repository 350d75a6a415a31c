"""The live forecast's cost (a benchmark, not a test; results go in BENCHMARKS.md).

Two parts, on a real CUDA caching allocator (`--allocator cuda`, the default where torch sees a GPU) or on
the caching-allocator simulator behind `set_allocator_source` (`--allocator sim`, as the lab server):

1. cost: the forecast thread's work per cycle at a few allocator sizes (live segments, half of them with a
   live block, the others cached and free): taking the snapshot (`torch.cuda.memory_snapshot()`, or the
   simulator's; on CUDA also the native reader's bytes, telemetry/hook/forecast/snapshot_native, and their
   decoding in the helper), reading it (`read_allocator_state`) and simulating the prefill of each length
   (`forecast`), in CPU ms (the thread's CPU time) and wall ms, the median of --repeats; and for each snapshot
   reader the longest another Python thread waited for the GIL while it ran (`stall`: a ticking thread's
   largest gap while the snapshot is taken --repeats times, 2 ms apart);
2. hooked call: the per-call wall time of a hooked logits launch (`indexer_logits_launch`: a float32
   [64, 4096 or 4160] block from the cache, the previous one freed), called back to back for --seconds, with the
   forecast off (`off`), with its thread running all along (every --interval seconds, at --hooked-segments
   segments, every cycle simulating: the shortcut for an unchanged allocator is cleared) and its helper process
   (`on`: on CUDA the native snapshot reader's first snapshot, then the allocator's events replayed in the helper,
   telemetry/hook/forecast/shadow.py; `on_full`: the native reader's full snapshot every cycle,
   MEMTEL_FORECAST_SHADOW=off; `on_python`: torch's memory_snapshot(), MEMTEL_FORECAST_SNAPSHOT=python), and
   simulating in the serving process (`in_process`), the --variants chosen, each in its own
   process, interleaved over --rounds: p50, p99, p99.9 and max, and the forecast's CPU time meanwhile, in the
   serving process and in its helper. Back to back is the worst case: the thread competes for the GIL
   with every call (and for the allocator's lock while it copies the segments: torch's, or the simulator
   backend's).

    PYTHONPATH=. python benchmarks/forecast_bench.py [--allocator cuda|sim] [--segments 10,100,556,2000]
        [--tokens 100000,200000] [--seconds 10] [--rounds 3] [--json out.json]

The workload is IndexerShape's reference (45 layers, 8,192-token chunks, compress ratio 4, max-model-len
204,800, 512 MiB budget), stock width, the default allocator settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from telemetry import hook_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import cpu_model

ROWS, WIDTH = 64, 4096
# The hooked-call part's variants: no forecast; the forecast thread with the longest-prefill search, simulating in
# its helper process; the same thread simulating in this process (as before the helper).
VARIANTS = ("off", "on", "on_full", "on_python", "in_process")
SEARCH_HEADROOM = 16 << 30   # the node headroom the hooked-call part's fit budget is read from (the search's limit)
MiB = 1 << 20


class Allocator:
    """The allocator under test: a CudaBackend or a SimBackend, with the snapshot the forecast thread takes."""

    def __init__(self, kind: str) -> None:
        from telemetry.model.indexer.backends import CudaBackend, SimBackend

        self.kind = kind
        backend: Any = CudaBackend(0) if kind == "cuda" else SimBackend("")
        self.backend = backend
        self.kept: list[object] = []
        self.previous: object | None = None
        self.calls = 0
        self.device: int | None = backend.index if kind == "cuda" else None

    def fill(self, segments: int) -> None:
        """From an empty allocator, `segments` segments: alternately a small-pool one (two 1 MiB blocks) and a
        large one (one block of 10-16 MiB, its own segment); every allocation first (so none reuses a cached
        block), then half of the segments' blocks freed: they stay cached, free."""
        slots = []
        for i in range(segments):
            if i % 2:
                slots.append([self.backend.alloc(MiB), self.backend.alloc(MiB)])
            else:
                slots.append([self.backend.alloc((10 + 2 * (i // 2 % 4)) * MiB)])
        for i, blocks in enumerate(slots):
            if i % 4 < 2:
                self.kept += blocks
            else:
                for block in blocks:
                    self.backend.release(block)
                blocks.clear()

    def empty(self) -> None:
        """Free everything and give the cached segments back (the next fill starts from nothing)."""
        for block in self.kept:
            self.backend.release(block)
        self.kept.clear()
        if self.kind == "cuda":
            self.backend.torch.cuda.synchronize()
            self.backend.torch.cuda.empty_cache()
        else:
            self.backend.main.empty_cache()

    def snapshot(self) -> Any:
        if self.kind == "cuda":
            from telemetry.hook.allocator import cuda_memory_snapshot

            return cuda_memory_snapshot(self.backend.torch)
        return self.backend.snapshot()   # under the backend's lock, between two ops

    def counters(self) -> Any:
        return self.backend.counters()

    def launch(self) -> None:
        """One logits launch, kept alive until the next (as the indexer's pipeline keeps the previous one), of
        two alternating widths."""
        self.calls += 1
        width = WIDTH + 64 * (self.calls % 2)
        current = self.backend.launch(ROWS, width, width)
        if self.previous is not None:
            self.backend.release(self.previous)
        self.previous = current


def timed(fn: Any) -> tuple[Any, float, float]:
    cpu, wall = time.thread_time(), time.perf_counter()
    value = fn()
    return value, (time.thread_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3


def stall(fn: Any, repeats: int, work: Any = None) -> float:
    """The longest gap, in ms, of a thread ticking in Python (calling `work()` at each tick, if given) while this
    thread calls `fn` `repeats` times 2 ms apart: how long a serving thread can wait because of `fn` (for the GIL;
    with `work` allocating on the device, for the allocator's lock too)."""
    import threading

    done = threading.Event()
    longest = [0.0]

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            if work is not None:
                work()
            now = time.perf_counter()
            longest[0] = max(longest[0], now - last)
            last = now

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.01)
    longest[0] = 0.0
    for _ in range(repeats):
        fn()
        time.sleep(0.002)
    done.set()
    thread.join()
    return longest[0] * 1e3


def allocate_1kib(torch: Any) -> Any:
    def allocate() -> None:
        torch.empty(1024, dtype=torch.uint8, device="cuda")

    return allocate


def native_reader() -> Any:
    """The native snapshot reader, built (into the cache) and loaded here, or None where it is off."""
    from telemetry.hook.forecast.snapshot_native.reader import NativeSnapshots

    native = NativeSnapshots()
    started = time.monotonic()
    while native.take() is None and native.off is None and time.monotonic() - started < 900:
        time.sleep(0.5)
    print(f"native snapshot reader: {native.reader} after {time.monotonic() - started:.1f} s"
          + (f" ({native.off})" if native.off else ""), flush=True)
    return native if native.module is not None else None


def cost(kind: str, segments: list[int], tokens: list[int], repeats: int, fit_budget: int) -> list[dict]:
    import marshal

    from telemetry.hook.forecast.helper import BATCH_SEGMENTS
    from telemetry.hook.forecast.snapshot_native.codec import decode_snapshot
    from telemetry.model.allocsim.snapshot import read_allocator_state, released_cache
    from telemetry.model.indexer.fit import max_prefill_tokens
    from telemetry.model.indexer.forecast import forecast
    from telemetry.model.indexer.shape import REFERENCE_SHAPE

    rows = []
    allocator = Allocator(kind)
    native = native_reader() if kind == "cuda" else None
    for target in sorted(segments):
        allocator.empty()
        allocator.fill(target)
        parts: dict[str, list[tuple[float, float]]] = {"snapshot": [], "read": []}
        growth = {}
        for _ in range(repeats):
            doc, cpu, wall = timed(allocator.snapshot)
            parts["snapshot"].append((cpu, wall))
            state, cpu, wall = timed(lambda doc=doc: read_allocator_state(doc, device=allocator.device))
            parts["read"].append((cpu, wall))
            for n in tokens:
                result, cpu, wall = timed(lambda n=n, state=state: forecast(state, REFERENCE_SHAPE, n, alloc_conf=""))
                parts.setdefault(f"forecast {n}", []).append((cpu, wall))
                growth[n] = result.reserved_growth_bytes
            limit = state.counters.allocated_bytes + fit_budget
            fit, cpu, wall = timed(lambda state=state, limit=limit: max_prefill_tokens(
                state, REFERENCE_SHAPE, limit_bytes=limit, alloc_conf=""))
            parts.setdefault("search", []).append((cpu, wall))
            # At best (compute.py): the state with the cache released, searched against the same limit. The cycle
            # skips it where nothing is cached or the limit now is max-model-len already; timed here either way.
            emptied, cpu, wall = timed(lambda state=state: released_cache(state))
            parts.setdefault("release cache", []).append((cpu, wall))
            best, cpu, wall = timed(lambda emptied=emptied, limit=limit: max_prefill_tokens(
                emptied, REFERENCE_SHAPE, limit_bytes=limit, alloc_conf=""))
            parts.setdefault("search at best", []).append((cpu, wall))
            _, cpu, wall = timed(lambda doc=doc: [marshal.dumps(doc[i:i + BATCH_SEGMENTS])
                                                  for i in range(0, len(doc), BATCH_SEGMENTS)])
            parts.setdefault("encode", []).append((cpu, wall))
            if native is not None:
                data, cpu, wall = timed(native.take)
                parts.setdefault("native snapshot", []).append((cpu, wall))
                _, cpu, wall = timed(lambda data=data: decode_snapshot(data))
                parts.setdefault("native decode", []).append((cpu, wall))
        stalls = {"memory_snapshot": stall(allocator.snapshot, max(repeats, 5))}
        if native is not None:
            stalls["native"] = stall(native.take, max(repeats, 5))
            # A thread allocating 1 KiB blocks meanwhile (as a hooked call allocates): it also waits for the
            # allocator's lock, which torch holds while it copies the segments (with either reader).
            allocate = allocate_1kib(allocator.backend.torch)
            stalls["memory_snapshot, allocating"] = stall(allocator.snapshot, max(repeats, 5), allocate)
            stalls["native, allocating"] = stall(native.take, max(repeats, 5), allocate)
            stalls["nothing, allocating"] = stall(lambda: None, max(repeats, 5), allocate)
            state_native = read_allocator_state(decode_snapshot(native.take()), device=allocator.device)
            assert state_native == read_allocator_state(allocator.snapshot(), device=allocator.device)
        median = {name: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
                  for name, v in parts.items()}
        row = {"segments": len(state.segments) + len(state.private_segments), "live_blocks": state.live_blocks(),
               "reserved_mib": state.counters.reserved_bytes / MiB,
               **{f"{name} cpu_ms": round(c, 3) for name, (c, _) in median.items()},
               **{f"{name} wall_ms": round(w, 3) for name, (_, w) in median.items()},
               "cycle_cpu_ms": round(sum(c for name, (c, _) in median.items() if not name.startswith("native")), 3),
               # What stays in the serving process with the helper: the snapshot and its encoding (torch's), or
               # the native reader's bytes (the GIL released while they are made).
               "serving_cpu_ms": round(median["snapshot"][0] + median["encode"][0], 3),
               "serving_native_cpu_ms": round(median["native snapshot"][0], 3) if native is not None else None,
               "gil_stall_ms": {name: round(v, 3) for name, v in stalls.items()},
               "snapshot_bytes": len(data) if native is not None else None,
               "growth_mib": {n: g / MiB for n, g in growth.items()},
               "fit_budget_mib": fit_budget / MiB, "max_prefill_tokens": fit.tokens, "search_runs": fit.simulations,
               "at_best_tokens": best.tokens, "at_best_search_runs": best.simulations,
               "released_mib": (state.counters.reserved_bytes - emptied.counters.reserved_bytes) / MiB}
        rows.append(row)
        print(f"{row['segments']:>6} segments ({row['live_blocks']} live blocks, {row['reserved_mib']:,.0f} MiB): "
              f"snapshot {median['snapshot'][0]:.2f} ms, read {median['read'][0]:.2f} ms, "
              + ", ".join(f"{n:,} tokens {median[f'forecast {n}'][0]:.1f} ms" for n in tokens)
              + f", search {median['search'][0]:.1f} ms ({fit.simulations} prefills, answer {fit.tokens:,} tokens in "
              f"{fit_budget / MiB:,.0f} MiB), at best: release {median['release cache'][0]:.2f} ms and search "
              f"{median['search at best'][0]:.1f} ms ({best.simulations} prefills, {best.tokens:,} tokens with "
              f"{row['released_mib']:,.0f} MiB released), encode {median['encode'][0]:.2f} ms; "
              f"cycle {row['cycle_cpu_ms']:.1f} ms "
              f"CPU, {row['serving_cpu_ms']:.2f} ms of it in the serving process"
              + ("" if native is None else f"; native snapshot {median['native snapshot'][0]:.2f} ms CPU "
                 f"({median['native snapshot'][1]:.2f} ms wall, {row['snapshot_bytes']:,} bytes), its decode in the "
                 f"helper {median['native decode'][0]:.2f} ms") + "; GIL stall: "
              + ", ".join(f"{name} {v:.2f} ms" for name, v in stalls.items()), flush=True)
    return rows


def hooked_child(kind: str, variant: str, segments: int, tokens: list[int], seconds: float,
                 interval: float) -> dict:
    forecast_on = variant != "off"
    if variant == "on_python":
        os.environ[hook_env.FORECAST_SNAPSHOT] = "python"
    if variant == "on_full":
        os.environ[hook_env.FORECAST_SHADOW] = "off"
    import telemetry
    from telemetry.fit_budget import set_forecast_budget
    from telemetry.hook import set_allocator_source
    from telemetry.hook.forecast import set_forecast_workload
    from telemetry.hook.forecast.snapshot_native.reader import coalesced
    from telemetry.model.indexer.shape import REFERENCE_SHAPE

    allocator = Allocator(kind)
    allocator.fill(segments)
    if kind == "sim":
        set_allocator_source(allocator.counters, snapshot=allocator.snapshot)
    # A fixed node headroom for the fit budget on both allocators (a whole H200's free memory would let the search
    # stop after one simulated prefill): the search does the work it does on a node with 16 GiB to spare.
    set_forecast_budget(lambda: SEARCH_HEADROOM, reserve_mib=0)
    set_forecast_workload(REFERENCE_SHAPE, alloc_conf="")
    options: dict[str, Any] = {"forecast_tokens": tuple(tokens), "forecast_interval_s": interval} if forecast_on else {}
    handle = telemetry.install(["telemetry.model.indexer.launch:indexer_logits_launch"], port=None, **options)
    for _ in range(200):   # warm-up; the first call starts the process (and the forecast thread)
        allocator.launch()
    forecaster = handle.forecaster
    if forecaster is not None:
        if variant == "in_process":
            forecaster._helper = None
        deadline = time.monotonic() + 300
        while not forecaster.results.forecasts and time.monotonic() < deadline:
            time.sleep(0.05)
        # The native reader loads from the cache (the parent built it) at the first cycle.
        while (kind == "cuda" and variant in ("on", "on_full") and forecaster.results.snapshot_reader != "native"
               and time.monotonic() < deadline):
            time.sleep(0.05)
        # Every cycle simulates: the shortcut for an unchanged allocator is cleared before each (the worst case).
        run_once = forecaster.run_once

        def simulate_every_cycle() -> bool:
            forecaster._last_key = None
            return run_once()

        forecaster.run_once = simulate_every_cycle  # type: ignore[method-assign]
    before = forecaster.results.cpu_seconds if forecaster else 0.0
    helper_before = forecaster.results.helper_cpu_seconds if forecaster else 0.0
    cycles_before = forecaster.results.last_success_s if forecaster else None
    clock = time.perf_counter_ns
    samples = []
    started = clock()
    end = started + int(seconds * 1e9)
    t0 = started
    while t0 < end:
        allocator.launch()
        t1 = clock()
        samples.append(t1 - t0)
        t0 = t1
    seconds = (t0 - started) / 1e9
    if kind == "cuda":
        allocator.backend.finish()
    thread_cpu = (forecaster.results.cpu_seconds - before) if forecaster else 0.0
    helper_cpu = (forecaster.results.helper_cpu_seconds - helper_before) if forecaster else 0.0
    fit = forecaster.results.max_fit if forecaster else None
    reader = forecaster.results.snapshot_reader if forecaster else None
    native = getattr(forecaster, "_native", None)
    pairs_left_out = coalesced(native.module) if native is not None and native.module is not None else None
    advanced = forecaster is not None and forecaster.results.last_success_s != cycles_before
    handle.uninstall()
    samples.sort()

    def at(q: float) -> float:
        return samples[min(len(samples) - 1, int(q * len(samples)))] / 1e3

    return {"forecast": forecast_on, "calls": len(samples), "seconds": seconds, "p50_us": at(0.5), "p99_us": at(0.99),
            "p999_us": at(0.999), "max_us": samples[-1] / 1e3, "mean_us": sum(samples) / len(samples) / 1e3,
            "forecast_cpu_s_during": thread_cpu, "helper_cpu_s_during": helper_cpu,
            "max_prefill_tokens": None if fit is None else fit.tokens, "cycles_advanced": advanced,
            "snapshot_reader": reader, "resyncs": forecaster.results.resyncs if forecaster else {},
            "coalesced": pairs_left_out}


def hooked(kind: str, segments: int, tokens: list[int], seconds: float, rounds: int, interval: float,
           variants: list[str]) -> dict:
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant in variants:
            command = [sys.executable, __file__, "--child", variant, "--allocator", kind, "--hooked-segments",
                       str(segments), "--tokens", ",".join(map(str, tokens)), "--seconds", str(seconds),
                       "--interval", str(interval)]
            out = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                                 env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
            if out.returncode != 0:
                raise SystemExit(f"hooked-call child failed:\n{out.stderr[-4000:]}")
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {}
    for variant, results in runs.items():
        summary[variant] = {key: statistics.median(r[key] for r in results)
                            for key in ("calls", "p50_us", "p99_us", "p999_us", "max_us", "mean_us", "seconds",
                                        "forecast_cpu_s_during", "helper_cpu_s_during")}
        s = summary[variant]
        print(f"hooked call, forecast {variant:>11}: p50 {s['p50_us']:.1f} us, p99 {s['p99_us']:.1f} us, "
              f"p99.9 {s['p999_us']:.1f} us, max {s['max_us']:.0f} us over {s['calls']:,.0f} calls "
              f"({s['seconds']:.1f} s); "
              f"forecast CPU meanwhile {s['forecast_cpu_s_during']:.2f} s here, "
              f"{s['helper_cpu_s_during']:.2f} s in its helper; max prefill tokens "
              f"{[r['max_prefill_tokens'] for r in results]}; snapshot reader "
              f"{[r['snapshot_reader'] for r in results]}; resyncs {[r.get('resyncs') for r in results]}; "
              f"alloc/free pairs left out of the event log {[r.get('coalesced') for r in results]}", flush=True)
    return {"segments": segments, "seconds": seconds, "rounds": rounds, "interval_s": interval, "runs": runs,
            "median": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--allocator", choices=("cuda", "sim"), default=None,
                        help="cuda (default where torch sees a GPU) or sim")
    parser.add_argument("--segments", default="10,100,556,2000", help="allocator sizes for the cost part")
    parser.add_argument("--tokens", default="100000,200000", help="forecast lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hooked-segments", default="556",
                        help="allocator sizes in the hooked-call part, e.g. 556,5000")
    parser.add_argument("--seconds", type=float, default=10.0, help="hooked calls for this long per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=float, default=1.0, help="forecast interval in the hooked-call part")
    parser.add_argument("--skip-hooked", action="store_true", help="only the cost part")
    parser.add_argument("--variants", default="off,on,on_python",
                        help=f"hooked-call variants, of {', '.join(VARIANTS)}")
    parser.add_argument("--fit-budget-gb", type=float, default=16.0,
                        help="the cost part's fit budget beyond the live bytes, for the longest-prefill search")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    if not variants or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: a comma-separated list of {', '.join(VARIANTS)}")
    if min(args.repeats, args.rounds) < 1 or args.seconds <= 0:
        parser.error("--repeats and --rounds must be at least 1, --seconds above 0")
    kind = args.allocator
    if kind is None:
        from telemetry.model.indexer.backends import cuda_available

        kind = "cuda" if cuda_available() else "sim"
    if args.child:
        print(json.dumps(hooked_child(kind, args.child, int(args.hooked_segments), tokens, args.seconds,
                                      args.interval)))
        return 0
    machine: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                               "allocator": kind}
    if kind == "cuda":
        import torch

        machine.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0))
    print(json.dumps(machine), flush=True)
    result: dict[str, Any] = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "tokens": tokens,
                              "cost": cost(kind, [int(s) for s in args.segments.split(",")], tokens, args.repeats,
                                           int(args.fit_budget_gb * (1 << 30)))}
    if not args.skip_hooked:
        result["hooked"] = [hooked(kind, int(n), tokens, args.seconds, args.rounds, args.interval, variants)
                            for n in args.hooked_segments.split(",")]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
