"""`memtel demo`: the whole A/B pipeline on this machine, in one command.

    memtel demo [--out DIR] [--allocator cuda|sim] [--scale S]

It starts the node daemon, then runs the A/B ladder through the harness (`memtel ab`): a fresh serve
of a stock and of a fixed-width lab server (`memtel lab serve`, two ranks each, memtel's hook on every
rank), a cold ~100k-token prefill, another ~100k with different content, then ~200k. It writes the
report (tables and plots) with a section of its own in front (the lab's shapes, what the simulator
predicts for them, what host memory and TTFT can and cannot show on this machine) and prints where it
is. Every process it starts is stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.ab.config import DEFAULT_STEPS, Step
from harness.demo.setup import DemoSetup
from harness.ports import free_port_block
from harness.processes import die_with_parent, wait_healthy
from telemetry import hook_env, limits
from telemetry.argtypes import bounded_float, bounded_int, fraction, shown
from telemetry.errors import ConfigError, RunError
from telemetry.model.indexer.backends import ALLOCATORS, cuda_available, default_allocator
from telemetry.model.indexer.planner import MODES
from telemetry.model.indexer.shape import add_shape_arguments, shape_from_args

DEMO_MODEL = "lab"
MAX_TOKENS = 16  # output tokens per request


def _steps(text: str) -> list[Step]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if len(parts) > limits.MAX_STEPS:
        raise argparse.ArgumentTypeError(f"expected at most {limits.MAX_STEPS:,} token counts, got {len(parts):,}")
    if not all(part.isascii() and part.isdigit() and len(part) <= 30 for part in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 100000,100000,200000, "
                                         f"got {shown(text)}")
    tokens = [int(part) for part in parts]
    if not tokens or any(t < limits.MIN_STEP_TOKENS for t in tokens):
        raise argparse.ArgumentTypeError(f"expected token counts of at least {limits.MIN_STEP_TOKENS}, "
                                         f"got {shown(text)}")
    if any(t > limits.MAX_PREFILL_TOKENS for t in tokens):
        raise argparse.ArgumentTypeError(f"expected token counts of at most {limits.MAX_PREFILL_TOKENS:,}, "
                                         f"got {shown(text)}")
    return [Step(f"step{i + 1}-{_short(t)}", t, i + 1) for i, t in enumerate(tokens)]


def _short(tokens: int) -> str:
    return f"{tokens // 1000}k" if tokens >= 1000 and tokens % 1000 == 0 else str(tokens)


def configure(parser: argparse.ArgumentParser) -> None:
    from harness.labserver.engine import DEFAULT_SIM_SCALE, DEFAULT_SIM_TIME_SCALE

    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--out", default=None,
                        help="run directory (default memtel-demo/<UTC date-time> under the current directory)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default=None,
                        help="cuda: real CUDA allocations on the GPU(s); sim: the caching-allocator simulator with "
                             "host-backed segments (unified-memory emulation). Default: cuda when a GPU is available")
    parser.add_argument("--scale", type=fraction, default=None,
                        help=f"multiply the rows (so the bytes) of every logits launch by S (default "
                             f"{DEFAULT_SIM_SCALE} with sim: about 2.5 GiB of host memory at the stock arm's peak; "
                             f"1 with cuda)")
    guard = parser.add_argument_group("the guard (memtel demo --guard: harness/demo/guarded.py)")
    guard.add_argument("--guard", action="store_true",
                       help="instead of the A/B ladder: a small lab node takes 32k, 100k and 1M-token prompts "
                            "without and with `memtel guard`, then a burst of long prompts while another tenant holds "
                            "part of its memory, without and with the guard's queue; the report says what each did")
    guard.add_argument("--capacity-gb", type=bounded_float(0, limits.MAX_CAPACITY_GIB, above_minimum=True),
                       default=None, help="--guard: the lab node's memory in GiB (default 1.5: 100k fits, 1M not)")
    advanced = parser.add_argument_group("advanced (shapes of the lab servers and the ladder)")
    advanced.add_argument("--steps", type=_steps, default=None,
                          help="the ladder's prompt sizes in tokens (default "
                               f"{','.join(str(s.tokens) for s in DEFAULT_STEPS)})")
    add_shape_arguments(advanced)
    advanced.add_argument("--ranks", type=bounded_int(1, limits.MAX_LAB_RANKS), default=2,
                          help="ranks per lab server (default 2)")
    advanced.add_argument("--time-scale", type=bounded_float(0, limits.MAX_TIME_SCALE),
                          default=DEFAULT_SIM_TIME_SCALE,
                          help=f"sim: multiply the cost model's time (default {DEFAULT_SIM_TIME_SCALE}: a 100k-token "
                               f"prefill takes ~2.7 s instead of ~54 s)")
    advanced.add_argument("--overwrite", action="store_true", help="replace a finished run in --out")


# --- processes ---------------------------------------------------------------------------------


@dataclass
class Daemon:
    """The node daemon as a child: its own session (a terminal Ctrl-C reaches only the demo, which
    stops it), and SIGTERM if the demo dies without cleaning up."""

    port: int
    state_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def command(self) -> list[str]:
        return ["memtel", "daemon", "--listen", f"127.0.0.1:{self.port}", "--state-dir", str(self.state_dir)]

    def start(self, timeout_s: float = 30.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "telemetry", *self.command()[1:]],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=die_with_parent,
            )
        wait_healthy(self.metrics_url, self.process, timeout_s=timeout_s, log_path=self.log_path,
                     what="the node daemon", error=RunError, interval_s=0.2)

    def stop(self, grace_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- the ladder --------------------------------------------------------------------------------


def build_ladder(setup: DemoSetup, steps: list[Step], daemon_url: str, ports: dict[str, tuple[int, int]]) -> dict:
    """The ladder file's data: two served arms that differ only in their width mode."""
    arms = []
    for mode in MODES:
        port, rank_base = ports[mode]
        command = [sys.executable, "-m", "telemetry", "lab", "serve", "--arm", mode, "--listen", f"127.0.0.1:{port}",
                   "--model-name", DEMO_MODEL, "--hook-listen", f"127.0.0.1:{rank_base}",
                   *setup.serve_args()]
        arms.append({
            "name": mode,
            "serve": {
                "command": command,
                "env": {hook_env.LOG_DIR: "{run_dir}/hook-logs/{arm}-r{repeat}"},
                "health_url": f"http://127.0.0.1:{port}/health",
                "startup_timeout_s": 120,
                "stop_grace_s": 15,
            },
            "ranks": {f"rank{r}": f"http://127.0.0.1:{rank_base + r}/metrics" for r in range(setup.ranks)},
        })
    return {
        "model": DEMO_MODEL,
        # The lab model cannot read: the needle column reads "n/a" instead of a meaningless "no".
        "request": {"max_tokens": MAX_TOKENS, "timeout_s": 600, "check_answer": False},
        "arms": arms,
        "nodes": {socket.gethostname(): daemon_url},
        "steps": [{"label": s.label, "tokens": s.tokens, "seed": s.seed} for s in steps],
        "repeats": 1,
        "order": "AABB",
        "sample_interval_s": 0.25,
    }


def ladder_text(data: dict, daemon: Daemon, run_dir: Path) -> str:
    """The ladder as YAML, headed by the commands that run it again (the demo's daemon is gone by then)."""
    import yaml

    head = [f"# The ladder of `memtel demo` (run directory {run_dir}). To run it again into OTHER:",
            f"#   {' '.join(daemon.command())} &",
            f"#   memtel ab run {run_dir / 'ladder.yaml'} --out OTHER",
            "#   kill %1",
            "# (the first starts a node daemon where this ladder's `nodes` expects it)."]
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False)


def run(args: argparse.Namespace) -> int:
    from harness.labserver.engine import DEFAULT_SIM_SCALE

    if args.guard:
        from harness.demo import guarded

        out = Path(args.out or Path("memtel-demo") / time.strftime("guard-%Y%m%d-%H%M%S", time.gmtime())).resolve()
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} is not a directory; expected a run directory")
        return guarded.run(out, args.capacity_gb or guarded.DEFAULT_CAPACITY_GB)
    if args.capacity_gb is not None:
        raise ConfigError("--capacity-gb is for --guard (the A/B demo's lab servers have no capacity limit)")
    allocator = args.allocator or default_allocator()
    if allocator == "cuda" and not cuda_available():
        raise ConfigError("--allocator cuda needs a CUDA GPU and a CUDA build of torch in this Python; "
                          "use --allocator sim")
    scale = args.scale if args.scale is not None else (DEFAULT_SIM_SCALE if allocator == "sim" else 1.0)
    setup = DemoSetup(allocator=allocator, scale=scale, time_scale=args.time_scale, ranks=args.ranks,
                      shape=shape_from_args(args))
    steps = args.steps or list(DEFAULT_STEPS)
    too_long = [s.tokens for s in steps if s.tokens + MAX_TOKENS > setup.shape.max_model_len]
    if too_long:
        raise ConfigError(f"steps of {too_long} tokens do not fit --max-model-len {setup.shape.max_model_len} "
                          f"(with {MAX_TOKENS} output tokens)")
    out = Path(args.out or Path("memtel-demo") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())).resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is not a directory; expected a run directory (new, or of an earlier demo)")
    from harness.ab.records import RESULTS_FILE

    results = out / RESULTS_FILE
    if not args.overwrite and results.exists() and results.stat().st_size > 0:
        # Before anything starts, and in the demo's words: it has no --resume (`memtel ab run` has).
        raise ConfigError(f"--out {out} already holds a run; pass --overwrite to replace it, or choose another --out")
    return run_demo(setup, steps, out, overwrite=args.overwrite)


def run_demo(setup: DemoSetup, steps: list[Step], out: Path, overwrite: bool = False) -> int:
    from harness.ab.config import Ladder
    from harness.ab.report import Report
    from harness.ab.runner import run_ladder
    from harness.demo.notes import build_notes

    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # One block of free ports: the daemon, then per arm the server and its ranks' exporters.
    base = free_port_block(1 + 2 * (1 + setup.ranks))
    daemon = Daemon(base, out / "daemon-state", out / "logs" / "daemon.log")
    ports: dict[str, tuple[int, int]] = {mode: (base + 1 + i * (1 + setup.ranks), base + 2 + i * (1 + setup.ranks))
                                         for i, mode in enumerate(MODES)}

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM stops the demo as Ctrl-C does (the harness does the same while the ladder runs).
    previous_sigterm = signal.signal(signal.SIGTERM, interrupt)
    print(f"memtel demo: {setup.allocator} allocator, scale {setup.scale:g}, {setup.ranks} ranks per server, "
          f"ladder {', '.join(f'{s.tokens:,}' for s in steps)} tokens; run directory {out}", flush=True)
    failure = None
    notes = None
    notes_error = ""
    path = out / "report.md"
    try:
        daemon.start()
        data = build_ladder(setup, steps, daemon.metrics_url, ports)
        (out / "ladder.yaml").write_text(ladder_text(data, daemon, out))
        ladder = Ladder.from_dict(data, source=str(out / "ladder.yaml"))
        run_ladder(ladder, out, overwrite=overwrite)
        report = Report.build(out)
        try:
            notes = build_notes(report, setup, steps)
        except Exception as exc:  # the harness's report stands without the demo's section
            notes_error = f"{type(exc).__name__}: {exc}"
        path = report.write(notes.sections if notes else (), notes.report_notes if notes else None,
                            notes.plot_caveats if notes else None)
        if notes is not None:
            notes.write_summary(out)
    except KeyboardInterrupt:
        failure = (130, "interrupted; every process it started has been stopped")
    except Exception as exc:  # a clear line, not a traceback, for the README's first command
        failure = (1, f"error: the demo failed: {type(exc).__name__}: {exc}")
    finally:
        daemon.stop()
        signal.signal(signal.SIGTERM, previous_sigterm)
    if failure is not None:
        print(f"\nmemtel demo: {failure[1]}", file=sys.stderr)
        return failure[0]
    # A new line first: the harness's status line may have left the cursor at its end.
    print(f"\nmemtel demo: done in {time.monotonic() - started:.0f} s. Report: {path}", flush=True)
    status = 0
    failed = [f for f in report.metrics.failures if f.kind != "not run"]
    if failed or report.run.stops:
        print(f"memtel demo: {len(failed)} request(s) failed or were skipped and {len(report.run.stops)} arm(s) "
              "stopped; see the report's \"Failed and skipped requests\"", file=sys.stderr)
        status = 1
    if notes is None:
        print(f"memtel demo: error: the demo's own report section could not be written: {notes_error}",
              file=sys.stderr)
        return 1
    for line in notes.console_lines():
        print(f"  {line}", flush=True)
    if not notes.prediction_agrees:
        print("memtel demo: warning: the ranks' allocator numbers differ from `memtel replay`'s prediction for the "
              "same shapes; see the report's first table", file=sys.stderr)
        status = 1 if setup.allocator == "sim" else status  # on sim they must agree; on CUDA it is a finding
    return status


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="memtel demo")
    configure(parser)
    sys.exit(run(parser.parse_args()))
