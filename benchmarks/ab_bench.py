"""A/B harness benchmark: TTFT agreement, the harness's own footprint, /tokenize calls per prompt.

    python benchmarks/ab_bench.py run LADDER.yaml --out DIR     # run `memtel ab run`, sample its RSS/CPU
    python benchmarks/ab_bench.py analyze DIR                   # the numbers, from DIR alone
    .venv-vllm/bin/python benchmarks/ab_bench.py tokenize       # /tokenize calls, byte-level BPE
    python benchmarks/ab_bench.py long --out DIR                # the 32k->1M ladder on lab servers: harness cost

Targets (issue 5): client TTFT within 2 % or 50 ms of the server's own TTFT
(vllm:time_to_first_token_seconds deltas) for the same request; the harness's RSS and CPU flat over a
200k-token ladder (no growth with prompt length, next to no CPU while a prefill runs); prompt
construction for 200k tokens in <= 3 /tokenize calls. Issue 13: the harness's own cost at 1M tokens
(peak RSS, CPU seconds, /tokenize time and calls; `memtel ab report`'s time and memory with ~10^5 hooked
calls per request; the hook log's disk use). Results go to BENCHMARKS.md by hand, with the date, the
machine and the command.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from telemetry import hook_env

ROOT = Path(__file__).resolve().parents[1]
FOOTPRINT = "harness_footprint.csv"


def run(ladder: Path, out: Path, interval: float, report: bool = True) -> int:
    """Run the harness as a child and sample its RSS and CPU time every `interval` s (not the servers')."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "harness.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "telemetry", "ab", "run", str(ladder), "--out", str(out),
                                 "--overwrite", *([] if report else ["--no-report"])], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    me = psutil.Process(proc.pid)
    started = time.monotonic()
    with open(out / FOOTPRINT, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "unix_ts", "rss_bytes", "cpu_s"])
        while proc.poll() is None:
            try:
                times, rss = me.cpu_times(), me.memory_info().rss
            except psutil.Error:
                break
            writer.writerow([f"{time.monotonic() - started:.2f}", f"{time.time():.3f}", rss,
                             f"{times.user + times.system:.3f}"])
            f.flush()
            time.sleep(interval)
    code = proc.wait()
    print(f"harness exit code {code}; footprint samples in {out / FOOTPRINT}")
    analyze(out)
    return code


def analyze(run_dir: Path) -> dict:
    from harness.ab.records import PromptBuilt, RequestDone, of_type, read_records

    results = run_dir / "results.jsonl"
    if not results.exists():
        raise SystemExit(f"ab_bench analyze: {results} does not exist: not a run directory of `memtel ab run`")
    records = read_records(results)
    requests = [r for r in of_type(records, RequestDone) if r.ok]
    prompts = of_type(records, PromptBuilt)
    out: dict = {"requests": []}
    print("\nTTFT agreement (client vs server, same request):")
    print(f"{'arm':8} {'step':14} {'tokens':>8} {'client s':>10} {'server s':>10} {'diff ms':>9} {'diff %':>7}  ok")
    for r in requests:
        client, server = r.ttft_s, r.server_ttft_s
        if client is None or server is None:
            continue
        diff = client - server
        rel = diff / server * 100 if server else float("inf")
        ok = abs(diff) <= 0.050 or abs(rel) <= 2.0
        out["requests"].append({"arm": r.arm, "step": r.step, "prompt_tokens": r.prompt_tokens, "client_s": client,
                                "server_s": server, "diff_ms": diff * 1000, "diff_pct": rel, "within_target": ok})
        print(f"{r.arm:8} {r.step:14} {r.prompt_tokens:>8} {client:>10.3f} {server:>10.3f} "
              f"{diff * 1000:>9.1f} {rel:>7.2f}  {'yes' if ok else 'NO'}")
    print("\nprompt construction:")
    for p in prompts:
        print(f"  {p.step:14} r{p.repeat} {p.prompt_tokens:>8} tokens: {p.tokenize_calls} /tokenize calls, "
              f"{p.build_s:.2f} s")
    out["tokenize_calls"] = {p.step: p.tokenize_calls for p in prompts}
    footprint = run_dir / FOOTPRINT
    if footprint.exists():
        rows = [(float(t), float(ts), int(rss), float(cpu)) for t, ts, rss, cpu in
                list(csv.reader(footprint.open()))[1:]]
        print("\nharness footprint per request (RSS at start/end, CPU used during the request):")
        for r in of_type(records, RequestDone):
            inside = [row for row in rows if r.started_at <= row[1] <= r.ended_at]
            if len(inside) < 2:
                continue
            cpu = inside[-1][3] - inside[0][3]
            wall = inside[-1][1] - inside[0][1]
            entry = {"arm": r.arm, "step": r.step, "rss_start_mib": inside[0][2] / 2**20,
                     "rss_end_mib": inside[-1][2] / 2**20, "cpu_s": cpu, "wall_s": wall,
                     "cpu_pct": 100 * cpu / wall if wall else 0.0}
            out.setdefault("footprint", []).append(entry)
            print(f"  {r.arm:8} {r.step:14} RSS {entry['rss_start_mib']:.1f} -> {entry['rss_end_mib']:.1f} MiB, "
                  f"CPU {cpu:.2f} s over {wall:.1f} s ({entry['cpu_pct']:.1f} %)")
        rss = [row[2] for row in rows]
        print(f"  whole run: RSS min {min(rss) / 2**20:.1f} MiB, max {max(rss) / 2**20:.1f} MiB, "
              f"CPU {rows[-1][3]:.1f} s over {rows[-1][0]:.0f} s")
        out["rss_min_mib"], out["rss_max_mib"] = min(rss) / 2**20, max(rss) / 2**20
    (run_dir / "bench.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def peak(command: list[str], interval: float = 0.05) -> tuple[int, float, float, int]:
    """Run `command`; (exit code, wall s, CPU s, peak RSS bytes) of that one process, sampled."""
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    me = psutil.Process(proc.pid)
    rss, cpu = 0, 0.0
    while proc.poll() is None:
        try:
            rss = max(rss, me.memory_info().rss)
            times = me.cpu_times()
            cpu = times.user + times.system
        except psutil.Error:
            break
        time.sleep(interval)
    return proc.wait(), time.monotonic() - started, cpu, rss


def long_context(out: Path, time_scale: float, scale: float, ranks: int) -> int:
    """The 32k->1M ladder (configs/ladders/long-context-32k-1m.yaml's steps) against two lab servers with
    max-model-len 1,048,576 and the reference shape, with a node daemon: what the harness itself costs."""
    import shutil

    import httpx
    import yaml

    from harness.ports import free_port

    out = out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    profile = yaml.safe_load((ROOT / "configs" / "ladders" / "long-context-32k-1m.yaml").read_text())
    daemon_port = free_port()
    daemon = subprocess.Popen([sys.executable, "-m", "telemetry", "daemon", "--listen", f"127.0.0.1:{daemon_port}",
                               "--state-dir", str(out / "daemon-state")], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{daemon_port}/metrics", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        arms = []
        for mode in ("stock", "fixed"):
            port, hook = free_port(), free_port()
            arms.append({"name": mode, "serve": {
                "command": [sys.executable, "-m", "telemetry", "lab", "serve", "--arm", mode, "--port", str(port),
                            "--model-name", "lab", "--allocator", "sim", "--ranks", str(ranks), "--max-model-len",
                            "1048576", "--scale", repr(scale), "--time-scale", repr(time_scale), "--memtel-port",
                            str(hook)],
                "env": {hook_env.LOG_DIR: "{run_dir}/hook-logs/{arm}-r{repeat}"},
                "health_url": f"http://127.0.0.1:{port}/health", "startup_timeout_s": 120, "stop_grace_s": 15},
                "ranks": {f"rank{r}": f"http://127.0.0.1:{hook + r}/metrics" for r in range(ranks)}})
        ladder = {"model": "lab", "request": {**profile["request"], "check_answer": False}, "arms": arms,
                  "nodes": {"local": f"http://127.0.0.1:{daemon_port}/metrics"}, "steps": profile["steps"],
                  "repeats": 1}
        ladder_path = out / "ladder.yaml"
        ladder_path.write_text(yaml.safe_dump(ladder, sort_keys=False))
        run_dir = out / "run"
        code = run(ladder_path, run_dir, 0.5, report=False)
    finally:
        daemon.terminate()
        daemon.wait(30)
    report_code, wall, cpu, rss = peak([sys.executable, "-m", "telemetry", "ab", "report", str(run_dir)])
    print(f"\n`memtel ab report` (reads every hook log): exit {report_code}, {wall:.1f} s wall, {cpu:.1f} s CPU, "
          f"peak RSS {rss / 2**20:.0f} MiB")
    _long_context_summary(run_dir)
    return code


def _long_context_summary(run_dir: Path) -> None:
    import gzip

    from harness.ab.records import PromptBuilt, RunEnd, of_type, read_records
    from telemetry.hook.call_log import call_log_files, read_call_columns

    records = read_records(run_dir / "results.jsonl")
    print("\nprompts (built once, shared by the arms):")
    for p in of_type(records, PromptBuilt):
        print(f"  {p.step:10} {p.prompt_tokens:>9,} tokens: {p.tokenize_calls} /tokenize calls, "
              f"{p.tokenize_s or 0:.2f} s waiting for them, {p.build_s:.2f} s to build")
    end = of_type(records, RunEnd)[-1]
    print(f"harness (`memtel ab run` process, by itself): {end.cpu_s:.1f} s CPU, peak RSS "
          f"{(end.max_rss_bytes or 0) / 2**20:.0f} MiB")
    print("hook logs:")
    for directory in sorted((run_dir / "hook-logs").iterdir()):
        files = call_log_files(directory)
        disk = sum(f.stat().st_size for f in files)
        raw = sum(len(gzip.decompress(f.read_bytes())) if f.name.endswith(".gz") else f.stat().st_size for f in files)
        calls = sum(len(c) for c in read_call_columns(directory).values())
        print(f"  {directory.name}: {calls:,} calls in {len(files)} files, {disk / 2**20:.1f} MiB on disk "
              f"({raw / 2**20:.1f} MiB uncompressed)")


def tokenize_calls(targets: list[int], url: str | None, model: str) -> None:
    """/tokenize calls per prompt: against a server, or a byte-level BPE trained here (needs `tokenizers`)."""
    from harness.ab.prompts import WORDS, build_prompt

    if url:
        import httpx

        from harness.ab.client import Tokenizer

        counter = Tokenizer(httpx.Client(), url.rstrip("/"), model)
        count, name = counter.count, f"{url} /tokenize"
    else:
        import importlib

        hf = importlib.import_module("tokenizers")  # installed where this mode runs (.venv-vllm), not in .venv
        decoders, models, pre_tokenizers, trainers = hf.decoders, hf.models, hf.pre_tokenizers, hf.trainers
        bpe = hf.Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        # A small vocabulary, so common words split into 1-3 pieces as in a real model's tokenizer.
        sample = [" ".join(WORDS[i:] + WORDS[:i]) + " Record 12-0 000123456. The secret code of the amber vault"
                  for i in range(0, len(WORDS), 7)]
        bpe.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=600, show_progress=False))
        count, name = (lambda text: len(bpe.encode(text).ids)), "byte-level BPE (vocab 600, trained here)"
    print(f"tokenizer: {name}")
    for target in targets:
        for seed in (1, 2, 3):
            started = time.perf_counter()
            prompt = build_prompt(target, seed, count)
            exact = count(prompt.text) == target
            print(f"  {target:>8} tokens seed {seed}: {prompt.tokenize_calls} calls, exact={exact}, "
                  f"{prompt.pad_words} pad words, {time.perf_counter() - started:.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("ladder", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--interval", type=float, default=1.0)
    p = sub.add_parser("analyze")
    p.add_argument("run_dir", type=Path)
    p = sub.add_parser("tokenize", help="/tokenize calls per prompt (a server, or a local BPE)")
    p.add_argument("--url", default=None, help="a vLLM server (default: a byte-level BPE trained here)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokens", type=int, nargs="+", default=[100_000, 200_000, 230_000])
    p = sub.add_parser("long", help="the 32k->1M ladder on lab servers: the harness's own cost at 1M tokens")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--time-scale", type=float, default=0.02)
    p.add_argument("--scale", type=float, default=0.05)
    p.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()
    if args.cmd == "run":
        return run(args.ladder, args.out, args.interval)
    if args.cmd == "long":
        return long_context(args.out, args.time_scale, args.scale, args.ranks)
    if args.cmd == "tokenize":
        tokenize_calls(args.tokens, args.url, args.model)
        return 0
    analyze(args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
