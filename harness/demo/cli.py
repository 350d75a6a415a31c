"""`memtel demo`: the whole A/B pipeline on this machine, in one command.

    memtel demo [--out DIR] [--allocator cuda|sim] [--scale S]

It starts the node daemon, then runs the A/B ladder through the harness (`memtel ab`): a fresh serve
of a stock and of a fixed-width lab server (`memtel lab serve`, two ranks each, memtel's hook on every
rank), a cold ~100k-token prefill, another ~100k with different content, then ~200k. It writes the
report (tables and plots), adds what the reader needs to read it (the lab's shapes, what the
simulator predicts for them, what host memory can and cannot show on this machine) and prints where
it is. Every process it starts is stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from harness.labserver.engine import ALLOCATORS
from harness.ports import free_port_block

DEFAULT_STEPS = ((100_000, "cold-100k"), (100_000, "cold-100k-b"), (200_000, "cold-200k"))
DEMO_MODEL = "lab"


@dataclass(frozen=True)
class DemoShape:
    """The lab servers' settings: the user's A/B profile, scaled to fit this machine."""

    allocator: str
    scale: float
    time_scale: float
    ranks: int = 2
    layers: int = 45
    chunk: int = 8192
    max_model_len: int = 204_800
    compress_ratio: int = 4
    budget_mb: float = 512.0

    def serve_args(self) -> list[str]:
        return ["--ranks", str(self.ranks), "--allocator", self.allocator, "--layers", str(self.layers),
                "--chunk", str(self.chunk), "--max-model-len", str(self.max_model_len),
                "--compress-ratio", str(self.compress_ratio), "--budget-mb", f"{self.budget_mb:g}",
                "--scale", f"{self.scale:g}", "--time-scale", f"{self.time_scale:g}"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _steps(text: str) -> list[tuple[int, str]]:
    try:
        tokens = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 100000,100000,200000, "
                                         f"got {text!r}") from None
    if not tokens or any(t < 64 for t in tokens):
        raise argparse.ArgumentTypeError(f"expected token counts of at least 64, got {text!r}")
    return [(t, f"step{i + 1}-{_short(t)}") for i, t in enumerate(tokens)]


def _short(tokens: int) -> str:
    return f"{tokens // 1000}k" if tokens >= 1000 and tokens % 1000 == 0 else str(tokens)


def configure(parser: argparse.ArgumentParser) -> None:
    from harness.labserver.cli import DEFAULT_SIM_SCALE, DEFAULT_SIM_TIME_SCALE, _fraction, _non_negative

    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--out", default=None,
                        help="run directory (default memtel-demo/<UTC date-time> under the current directory)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default=None,
                        help="cuda: real CUDA allocations on the GPU(s); sim: the caching-allocator simulator with "
                             "host-backed segments (unified-memory emulation). Default: cuda when a GPU is available")
    parser.add_argument("--scale", type=_fraction, default=None,
                        help=f"multiply the rows (so the bytes) of every logits launch by S (default "
                             f"{DEFAULT_SIM_SCALE} with sim: about 2.5 GiB of host memory at the stock arm's peak; "
                             f"1 with cuda)")
    advanced = parser.add_argument_group("advanced (shapes of the lab servers and the ladder)")
    advanced.add_argument("--steps", type=_steps, default=None,
                          help="the ladder's prompt sizes in tokens (default 100000,100000,200000)")
    advanced.add_argument("--layers", type=_positive_int, default=45, help="indexer layers (default 45)")
    advanced.add_argument("--chunk", type=_positive_int, default=8192, help="prefill chunk in tokens (default 8192)")
    advanced.add_argument("--max-model-len", type=_positive_int, default=204_800,
                          help="context limit; the fixed width is max-model-len / compress-ratio (default 204800)")
    advanced.add_argument("--compress-ratio", type=_positive_int, default=4, help="kv compress ratio (default 4)")
    advanced.add_argument("--budget-mb", type=float, default=512.0, help="logits budget per launch in MiB (default 512)")
    advanced.add_argument("--ranks", type=_positive_int, default=2, help="ranks per lab server (default 2)")
    advanced.add_argument("--time-scale", type=_non_negative, default=DEFAULT_SIM_TIME_SCALE,
                          help=f"sim: multiply the cost model's time (default {DEFAULT_SIM_TIME_SCALE}: a 100k-token "
                               f"prefill takes ~2.7 s instead of ~54 s)")
    advanced.add_argument("--overwrite", action="store_true", help="replace a finished run in --out")


# --- processes ---------------------------------------------------------------------------------


def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Daemon:
    """The node daemon as a child: its own session (a terminal Ctrl-C reaches only the demo, which
    stops it), and SIGTERM if the demo dies without cleaning up."""

    def __init__(self, port: int, state_dir: Path, log_path: Path) -> None:
        self.port = port
        self.state_dir = state_dir
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def start(self, timeout_s: float = 30.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "telemetry", "daemon", "--listen", f"127.0.0.1:{self.port}",
                 "--state-dir", str(self.state_dir)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the node daemon exited with {self.process.returncode}; "
                                       f"log {self.log_path}:\n{_tail(self.log_path)}")
                try:
                    if client.get(self.metrics_url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"the node daemon did not answer {self.metrics_url} in {timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{_tail(self.log_path)}")

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


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- the ladder --------------------------------------------------------------------------------


def build_ladder(shape: DemoShape, steps: list[tuple[int, str]], daemon_url: str, ports: dict) -> dict:
    """The ladder file's data: two served arms that differ only in --arm."""
    arms = []
    for arm in ("stock", "fixed"):
        port, rank_base = ports[arm]
        command = [sys.executable, "-m", "telemetry", "lab", "serve", "--arm", arm, "--port", str(port),
                   "--host", "127.0.0.1", "--model-name", DEMO_MODEL, "--memtel-port", str(rank_base),
                   *shape.serve_args()]
        arms.append({
            "name": arm,
            "serve": {
                "command": command,
                "env": {"MEMTEL_LOG_DIR": "{run_dir}/hook-logs/{arm}-r{repeat}"},
                "health_url": f"http://127.0.0.1:{port}/health",
                "startup_timeout_s": 120,
                "stop_grace_s": 15,
            },
            "ranks": {f"rank{r}": f"http://127.0.0.1:{rank_base + r}/metrics" for r in range(shape.ranks)},
        })
    return {
        "model": DEMO_MODEL,
        # The lab model cannot read: the needle column reads "n/a" instead of a meaningless "no".
        "request": {"max_tokens": 16, "timeout_s": 600, "check_answer": False},
        "arms": arms,
        "nodes": {socket.gethostname(): daemon_url},
        "steps": [{"label": label, "tokens": tokens, "seed": i + 1} for i, (tokens, label) in enumerate(steps)],
        "repeats": 1,
        "order": "AABB",
        "sample_interval_s": 0.25,
    }


def run(args: argparse.Namespace) -> int:
    from harness.labserver.cli import DEFAULT_SIM_SCALE, default_allocator

    allocator = args.allocator or default_allocator()
    if allocator == "cuda":
        try:
            import torch

            ok = torch.cuda.is_available()
        except ImportError:
            ok = False
        if not ok:
            print("memtel demo: --allocator cuda needs a CUDA GPU and a CUDA build of torch in this Python; "
                  "use --allocator sim", file=sys.stderr)
            return 2
    scale = args.scale if args.scale is not None else (DEFAULT_SIM_SCALE if allocator == "sim" else 1.0)
    shape = DemoShape(allocator=allocator, scale=scale, time_scale=args.time_scale, ranks=args.ranks,
                      layers=args.layers, chunk=args.chunk, max_model_len=args.max_model_len,
                      compress_ratio=args.compress_ratio, budget_mb=args.budget_mb)
    steps = args.steps or [(t, label) for t, label in DEFAULT_STEPS]
    too_long = [t for t, _ in steps if t + 16 > shape.max_model_len]
    if too_long:
        print(f"memtel demo: steps of {too_long} tokens do not fit --max-model-len {shape.max_model_len} "
              "(with 16 output tokens)", file=sys.stderr)
        return 2
    out = Path(args.out or Path("memtel-demo") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())).resolve()
    return run_demo(shape, steps, out, overwrite=args.overwrite)


def run_demo(shape: DemoShape, steps: list[tuple[int, str]], out: Path, overwrite: bool = False) -> int:
    from harness.ab.config import Ladder
    from harness.ab.report import write_report
    from harness.ab.runner import run_ladder
    from harness.demo.notes import write_notes

    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # One block of free ports: the daemon, then per arm the server and its ranks' exporters.
    base = free_port_block(1 + 2 * (1 + shape.ranks))
    daemon = Daemon(base, out / "daemon-state", out / "logs" / "daemon.log")
    ports = {arm: (base + 1 + i * (1 + shape.ranks), base + 2 + i * (1 + shape.ranks))
             for i, arm in enumerate(("stock", "fixed"))}

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM stops the demo as Ctrl-C does (the harness does the same while the ladder runs).
    previous_sigterm = signal.signal(signal.SIGTERM, interrupt)
    print(f"memtel demo: {shape.allocator} allocator, scale {shape.scale:g}, {shape.ranks} ranks per server, "
          f"ladder {', '.join(f'{t:,}' for t, _ in steps)} tokens; run directory {out}", flush=True)
    failure = None
    try:
        daemon.start()
        data = build_ladder(shape, steps, daemon.metrics_url, ports)
        import yaml

        (out / "ladder.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        ladder = Ladder.from_dict(data, source=str(out / "ladder.yaml"))
        results = run_ladder(ladder, out, overwrite=overwrite)
        report = write_report(out)
        try:
            notes = write_notes(out, report, shape, steps)
        except Exception as exc:  # the harness's report stands without the demo's section
            notes = {"error": f"{type(exc).__name__}: {exc}"}
    except KeyboardInterrupt:
        failure = (130, "interrupted; every process it started has been stopped")
    except Exception as exc:  # a clear line, not a traceback, for the README's first command
        failure = (1, f"failed: {type(exc).__name__}: {exc}")
    finally:
        daemon.stop()
        signal.signal(signal.SIGTERM, previous_sigterm)
    if failure is not None:
        print(f"\nmemtel demo: {failure[1]}", file=sys.stderr)
        return failure[0]
    # A new line first: the harness's status line may have left the cursor at its end.
    print(f"\nmemtel demo: done in {time.monotonic() - started:.0f} s. Report: {report}", flush=True)
    for arm, data in (notes.get("arms") or {}).items():
        last = data["steps"][-1] if data.get("steps") else None
        if last:
            reserved = [v for v in last["measured_reserved_after_bytes"].values() if v is not None]
            allocs = [v for v in last["measured_device_allocs_after"].values() if v is not None]
            if reserved and allocs:
                print(f"  {arm}: reserved +{max(reserved) / (1 << 20):,.0f} MiB per rank over the ladder, "
                      f"{int(max(allocs))} cudaMallocs", flush=True)
    status = 0
    failed = _failed_requests(results)
    if failed:
        print(f"memtel demo: {failed}; see the report's \"Failed and skipped requests\"", file=sys.stderr)
        status = 1
    if "error" in notes:
        print(f"memtel demo: the demo's own report section could not be written: {notes['error']}", file=sys.stderr)
        status = 1
    elif not notes.get("prediction_agrees"):
        print("memtel demo: warning: the ranks' allocator numbers differ from `memtel replay`'s prediction for the "
              "same shapes; see the report's first table", file=sys.stderr)
        status = 1 if shape.allocator == "sim" else status  # on sim they must agree; on CUDA it is a finding
    return status


def _failed_requests(results: Path) -> str | None:
    from harness.ab.records import read_records

    failed = stopped = 0
    for record in read_records(results):
        failed += record["event"] == "request" and not record.get("ok")
        stopped += record["event"] in ("arm_stopped", "step_skipped")
    if not failed and not stopped:
        return None
    return f"{failed} request(s) failed and {stopped} arm stop/skip record(s) were written"

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="memtel demo")
    configure(parser)
    sys.exit(run(parser.parse_args()))
