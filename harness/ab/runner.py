"""Runs a ladder: for each (arm, repeat) block a fresh serve (or the arm's own server), a baseline
scrape, then each step's prompt, streamed, with 1 s node sampling during it and a scrape after it.

The stages live in their own modules (config, prompts, client, serve, samplers, records); this one
only orders them, keeps the status line, and makes sure every server it started is stopped, on
success, on error and on Ctrl-C (SIGTERM is treated the same). `--resume` reruns only steps without a
`request` or `step_skipped` record; a block resumed mid-ladder gets a fresh serve and a new baseline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

from harness.ab.client import RequestResult, Tokenizer, stream_request
from harness.ab.config import Arm, Ladder, LadderError, Step, check_reachable
from harness.ab.prompts import Prompt, answer_found, build_prompt, load_words
from harness.ab.records import (
    RESULTS_FILE,
    ArmStopped,
    NodeSample,
    NodeSnapshot,
    PromptBuilt,
    Record,
    RecordWriter,
    RequestDone,
    RunEnd,
    RunStart,
    Scrape,
    ServeFailed,
    ServeReady,
    ServerInfo,
    ServerSnapshot,
    ServeStart,
    ServeStop,
    StepSkipped,
    finished_steps,
    of_type,
    read_records,
    unstopped_servers,
)
from harness.ab.samplers import NodeSampler, Scraper
from harness.ab.serve import ServedProcess, ServeError, kill_stale
from telemetry.errors import ConfigError

RUN_DIR_ENTRIES = (RESULTS_FILE, "report.md", "summary.json", "plots", "prompts", "logs", "hook-logs")
REPO_ROOT = Path(__file__).resolve().parents[2]


class RunDirError(ConfigError):
    """The run directory cannot be used as asked (finished run without --overwrite, other ladder)."""


def schedule(ladder: Ladder) -> list[tuple[Arm, int]]:
    """(arm, repeat) blocks: ABAB interleaves arms within each repeat, AABB runs each arm's repeats together."""
    if ladder.order == "AABB":
        return [(arm, r) for arm in ladder.arms for r in range(ladder.repeats)]
    return [(arm, r) for r in range(ladder.repeats) for arm in ladder.arms]


def environment() -> dict:
    from telemetry import __version__

    git_rev = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=5)
        git_rev = out.stdout.strip() or None
    return {
        "memtel_version": __version__, "git_revision": git_rev, "hostname": socket.gethostname(),
        "platform": platform.platform(), "python": platform.python_version(), "harness_pid": os.getpid(),
    }


def run_ladder(ladder: Ladder, out_dir: str | Path, resume: bool = False, overwrite: bool = False,
               console=None) -> Path:
    """Run (or resume) the ladder into out_dir; returns the path of results.jsonl."""
    out_dir = Path(out_dir)
    results = out_dir / RESULTS_FILE
    prior: list[Record] = []
    holds_run = results.exists() and results.stat().st_size > 0
    if holds_run:
        if resume:
            prior = read_records(results)
            _check_same_ladder(prior, ladder, out_dir)
        elif not overwrite:
            raise RunDirError(f"{out_dir} already holds a run ({RESULTS_FILE}); pass --resume to finish it "
                              "or --overwrite to start over")
    # Best effort: an old run's unreadable records must not stop --overwrite from replacing it.
    for record in unstopped_servers(read_records(results, skip_unreadable=True) if holds_run else []):
        kill_stale(record.pgid, record.command)  # a SIGKILLed harness may have left its server behind
    check_reachable(ladder)  # before anything starts, and before --overwrite deletes anything
    if holds_run and overwrite and not resume:
        for name in RUN_DIR_ENTRIES:
            path = out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = RecordWriter(results)
    try:
        with _sigterm_as_interrupt():
            _Run(ladder, out_dir, writer, prior, console).execute()
    finally:
        writer.close()
    return results


def _check_same_ladder(prior: list[Record], ladder: Ladder, out_dir: Path) -> None:
    starts = of_type(prior, RunStart)
    if not starts:
        return
    before = json.loads(json.dumps(starts[0].ladder.to_dict()))
    now = json.loads(json.dumps(ladder.to_dict()))
    if before != now:
        keys = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        raise RunDirError(f"{out_dir} was run with a different ladder (differs in: {', '.join(keys)}); "
                          "resume with the same file, or use another --out")


@contextlib.contextmanager
def _sigterm_as_interrupt():
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclasses.dataclass
class _Status:
    """What the live status line shows; updated by the run, rendered by rich twice a second."""
    phase: str = "starting"
    arm: str = "-"
    repeat: int = 0
    step: str = "-"
    step_index: int = 0
    steps: int = 0
    tokens: int = 0
    step_started: float = 0.0
    last_ttft: float | None = None
    run_started: float = dataclasses.field(default_factory=time.monotonic)

    def render(self):
        from rich.text import Text

        now = time.monotonic()
        elapsed = now - self.step_started if self.step_started else 0.0
        ttft = f"{self.last_ttft:.2f} s" if self.last_ttft is not None else "-"
        return Text.assemble(
            ("memtel ab ", "bold"), (f"{self.arm}", "cyan"), f" r{self.repeat} ",
            (f"{self.step}", "magenta"), f" ({self.step_index}/{self.steps}) ",
            f"{self.tokens:,} tokens · {self.phase} · step {elapsed:,.0f} s · run {now - self.run_started:,.0f} s",
            f" · last TTFT {ttft}",
        )


class _Run:
    def __init__(self, ladder: Ladder, out_dir: Path, writer: RecordWriter, prior: list[Record], console) -> None:
        from rich.console import Console

        self.ladder = ladder
        self.out_dir = out_dir
        self.writer = writer
        self.prior = prior
        self.done = finished_steps(prior)
        self.console = console or Console(stderr=True)
        self.status = _Status()
        self.scraper = Scraper()
        self.http = httpx.Client(timeout=30.0)
        self.prompts: dict[tuple[str, int], Prompt] = {}
        self.prompt_records = {(r.step, r.repeat): r for r in of_type(prior, PromptBuilt)}
        self.server: ServedProcess | None = None
        self.words = load_words(ladder.request.words_file) if ladder.request.words_file else None

    # -- top level --

    def execute(self) -> None:
        from rich.live import Live

        source_text = None
        with contextlib.suppress(OSError):
            source_text = Path(self.ladder.source).read_text()
        self.writer.write(RunStart(resumed=bool(self.prior), ladder=self.ladder, ladder_source=self.ladder.source,
                                   ladder_text=source_text, environment=environment()))
        status = "error"
        try:
            with Live(get_renderable=self.status.render, console=self.console, refresh_per_second=2,
                      transient=False):
                for arm, repeat in schedule(self.ladder):
                    self.run_block(arm, repeat)
            status = "complete"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            self.stop_server()
            self.writer.write(RunEnd(status=status))
            self.scraper.close()
            self.http.close()

    def log(self, message: str) -> None:
        self.console.print(message, highlight=False, markup=False)

    # -- servers --

    def start_server(self, arm: Arm, repeat: int) -> None:
        spec = arm.serve
        assert spec is not None
        fields = {"run_dir": str(self.out_dir.resolve()), "arm": arm.name, "repeat": str(repeat)}
        env = {k: _expand(v, fields) for k, v in spec.env.items()}
        extra_env = {}
        targets = env.get("MEMTEL_TARGETS") or (os.environ.get("MEMTEL_TARGETS") if spec.inherit_env else None)
        if targets and "MEMTEL_LOG_DIR" not in env:
            extra_env["MEMTEL_LOG_DIR"] = str(self.out_dir.resolve() / "hook-logs" / f"{arm.name}-r{repeat}")
        hook_log_dir = env.get("MEMTEL_LOG_DIR") or extra_env.get("MEMTEL_LOG_DIR")
        if hook_log_dir:
            Path(hook_log_dir).mkdir(parents=True, exist_ok=True)
        spec = dataclasses.replace(spec, env=env)
        log_name = _expand(spec.log_file, fields) if spec.log_file else f"logs/{arm.name}-r{repeat}-serve.log"
        log_path = self.out_dir / log_name
        self.status.phase = "starting server"
        server = ServedProcess(spec, log_path, extra_env=extra_env)
        server.start()
        self.server = server
        assert server.pid is not None
        self.writer.write(ServeStart(arm=arm.name, repeat=repeat, command=list(spec.command), env=spec.env,
                                     cwd=spec.cwd, pid=server.pid, pgid=server.pid, log=self.relative(log_path),
                                     hook_log_dir=self.relative(Path(hook_log_dir)) if hook_log_dir else None))
        seconds = server.wait_healthy()
        self.writer.write(ServeReady(arm=arm.name, repeat=repeat, pgid=server.pid, startup_s=seconds))
        self.log(f"[{arm.name} r{repeat}] server ready in {seconds:.1f} s (pid {server.pid})")

    def relative(self, path: Path) -> str:
        """Paths inside the run directory are recorded relative to it, so the directory can move."""
        try:
            return str(path.resolve().relative_to(self.out_dir.resolve()))
        except ValueError:
            return str(path)

    def stop_server(self) -> None:
        server, self.server = self.server, None
        if server is None or server.process is None:
            return
        self.status.phase = "stopping server"
        # A second Ctrl-C must not cut the stop short and leave the server behind.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if _main_thread() else None
        try:
            how = server.stop()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        self.writer.write(ServeStop(pgid=server.pid, how=how, exit_code=server.process.returncode))

    def server_alive(self, arm: Arm) -> bool:
        if self.server is not None:
            return self.server.alive()
        try:
            return self.http.get(arm.url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def server_info(self, arm: Arm, repeat: int, ranks: dict) -> None:
        info: dict = {}
        for key, path in (("version", "/version"), ("models", "/v1/models")):
            try:
                response = self.http.get(arm.url + path, timeout=10.0)
                info[key] = response.json() if response.status_code == 200 else f"HTTP {response.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                info[key] = f"unavailable: {type(exc).__name__}"
        rank_errors = {}
        for name, url in ranks.items():
            try:
                self.http.get(url, timeout=5.0).raise_for_status()
            except httpx.HTTPError as exc:
                rank_errors[name] = f"{url}: {type(exc).__name__}: {exc}"
        self.writer.write(ServerInfo(arm=arm.name, repeat=repeat, url=arm.url, version=info["version"],
                                     models=info["models"], rank_errors=rank_errors))
        for name, error in rank_errors.items():
            self.log(f"[{arm.name} r{repeat}] warning: rank {name} not reachable ({error})")

    # -- prompts --

    def model_name(self, arm: Arm) -> str:
        if self.ladder.model != "auto":
            return self.ladder.model
        response = self.http.get(arm.url + "/v1/models", timeout=10.0)
        return response.json()["data"][0]["id"]

    def prompt_for(self, step: Step, repeat: int, arm: Arm) -> Prompt:
        key = (step.label, repeat)
        if key in self.prompts:
            return self.prompts[key]
        path = self.out_dir / "prompts" / f"{step.label}-r{repeat}.txt"
        stored = self.prompt_records.get(key)
        if stored is not None and path.exists():
            text = path.read_text()
            prompt = Prompt(text=text, prompt_tokens=stored.prompt_tokens, needle=stored.needle,
                            answer=stored.answer, question=stored.question, seed=step.seed, repeat=repeat,
                            tokenize_calls=0, filler_words=stored.filler_words, pad_words=stored.pad_words)
            if prompt.sha256 == stored.sha256:
                self.prompts[key] = prompt
                return prompt
        self.status.phase = "building prompt"
        tokenizer = Tokenizer(self.http, arm.url, self.model_name(arm), api=self.ladder.request.api)
        started = time.perf_counter()
        prompt = build_prompt(step.tokens, step.seed, tokenizer.count, repeat=repeat,
                              needle_depth=self.ladder.request.needle_depth, words=self.words)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prompt.text)
        self.writer.write(PromptBuilt(
            step=step.label, repeat=repeat, seed=step.seed, target_tokens=step.tokens,
            prompt_tokens=prompt.prompt_tokens, tokenize_calls=prompt.tokenize_calls,
            build_s=time.perf_counter() - started, sha256=prompt.sha256, path=str(path.relative_to(self.out_dir)),
            needle=prompt.needle, answer=prompt.answer, question=prompt.question, filler_words=prompt.filler_words,
            pad_words=prompt.pad_words, built_with=arm.name, max_model_len=tokenizer.max_model_len))
        self.prompts[key] = prompt
        return prompt

    # -- one block: an arm's ladder for one repeat --

    def run_block(self, arm: Arm, repeat: int) -> None:
        todo = [s for s in self.ladder.steps if (arm.name, repeat, s.label) not in self.done]
        if not todo:
            return
        self.status.arm, self.status.repeat, self.status.steps = arm.name, repeat, len(self.ladder.steps)
        ranks = self.ladder.ranks_for(arm)
        try:
            if not self.bring_up(arm, repeat, ranks, todo):
                return
            index = 0
            while index < len(todo):
                step = todo[index]
                result = self.run_step(arm, repeat, step, ranks)
                index += 1
                if result.ok:
                    continue
                alive = self.server_alive(arm)
                rest = todo[index:]
                if self.ladder.on_error_for(arm) == "continue" and rest:
                    if alive:
                        continue
                    if arm.serve is not None:  # a served arm gets a fresh serve and goes on
                        self.log(f"[{arm.name} r{repeat}] server died; starting a fresh one for the rest")
                        self.stop_server()
                        if self.bring_up(arm, repeat, ranks, rest):
                            continue
                        return
                reason = ("server died" if not alive else "request failed") + f" at step {step.label}: {result.error}"
                self.stop_arm(arm, repeat, rest, reason)
                return
        finally:
            self.stop_server()

    def bring_up(self, arm: Arm, repeat: int, ranks: dict, todo: list[Step]) -> bool:
        """Start the arm's server if it is served, note its versions, build prompts, scrape the baseline."""
        try:
            if arm.serve is not None:
                self.start_server(arm, repeat)
            self.server_info(arm, repeat, ranks)
            for step in todo:
                self.prompt_for(step, repeat, arm)
        except (ServeError, httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
            if isinstance(exc, ServeError):
                self.writer.write(ServeFailed(arm=arm.name, repeat=repeat, error=str(exc)))
            self.stop_server()
            self.stop_arm(arm, repeat, todo, f"could not start: {type(exc).__name__}: {exc}")
            return False
        self.status.phase = "baseline scrape"
        snap = self.scraper.all(self.ladder.nodes, ranks, arm.url)
        self.writer.write(Scrape(phase="baseline", arm=arm.name, repeat=repeat, step=None, nodes=snap.nodes,
                                 ranks=snap.ranks, server=snap.server,
                                 resumed=any((arm.name, repeat, s.label) in self.done for s in self.ladder.steps)))
        return True

    def stop_arm(self, arm: Arm, repeat: int, rest: list[Step], reason: str) -> None:
        self.writer.write(ArmStopped(arm=arm.name, repeat=repeat, reason=reason))
        for step in rest:
            self.writer.write(StepSkipped(arm=arm.name, repeat=repeat, step=step.label, reason=reason))
        self.log(f"[{arm.name} r{repeat}] arm stopped: {reason}")

    def run_step(self, arm: Arm, repeat: int, step: Step, ranks: dict) -> RequestResult:
        prompt = self.prompts[(step.label, repeat)]
        self.status.step, self.status.tokens = step.label, prompt.prompt_tokens
        self.status.step_index = [s.label for s in self.ladder.steps].index(step.label) + 1
        before = self.scraper.server(arm.url)

        def on_sample(node: str, snap: NodeSnapshot) -> None:
            self.writer.write(NodeSample(arm=arm.name, repeat=repeat, step=step.label, node=node, snapshot=snap))

        self.status.phase = "prefill + decode"
        self.status.step_started = time.monotonic()
        with NodeSampler(self.ladder.nodes, self.ladder.sample_interval_s, on_sample) as sampler:
            result = stream_request(self.http, arm.url, self.model_name(arm), prompt.text, self.ladder.request)
        self.status.phase = "scraping"
        after = self.scraper.all(self.ladder.nodes, ranks, arm.url)
        server_ttft = _server_ttft(before, after.server)
        cache_hits = _cache_hit_delta(before, after.server)
        needle = answer_found(prompt.answer, result.text) if self.ladder.request.check_answer and result.ok else None
        usage = result.usage_prompt_tokens
        self.writer.write(RequestDone(
            arm=arm.name, repeat=repeat, step=step.label, seed=step.seed, target_tokens=step.tokens,
            prompt_tokens=prompt.prompt_tokens, prompt_sha256=prompt.sha256, usage_prompt_tokens=usage,
            prompt_tokens_match=(usage == prompt.prompt_tokens) if usage is not None else None,
            ok=result.ok, error=result.error, status_code=result.status_code, started_at=result.started_at,
            ended_at=result.ended_at, ttft_s=result.ttft_s, e2e_s=result.e2e_s, server_ttft_s=server_ttft,
            output_tokens=result.output_tokens, content_chunks=result.content_chunks,
            finish_reason=result.finish_reason, prefix_cache_hit_tokens=cache_hits, needle_found=needle,
            answer=prompt.answer, reply=result.text[:500], min_mem_available_bytes=sampler.min_mem_available,
            max_swap_used_bytes=sampler.max_swap_used, node_samples=sampler.samples))
        self.writer.write(Scrape(phase="after", arm=arm.name, repeat=repeat, step=step.label, nodes=after.nodes,
                                 ranks=after.ranks, server=after.server))
        self.done.add((arm.name, repeat, step.label))
        self.status.last_ttft = result.ttft_s
        if result.ok:
            self.log(f"[{arm.name} r{repeat}] {step.label}: {prompt.prompt_tokens:,} tokens, "
                     f"TTFT {result.ttft_s or 0:.3f} s "
                     f"(server {server_ttft if server_ttft is None else round(server_ttft, 3)} s), "
                     f"e2e {result.e2e_s:.2f} s, {result.output_tokens} output tokens")
        else:
            self.log(f"[{arm.name} r{repeat}] {step.label}: FAILED: {result.error}")
        return result


def _server_ttft(before: ServerSnapshot | None, after: ServerSnapshot | None) -> float | None:
    """The server's own TTFT for the one request between two scrapes (sum/count deltas)."""
    if before is None or after is None or before.error or after.error:
        return None
    if before.ttft_sum_s is None or after.ttft_sum_s is None or before.ttft_count is None or after.ttft_count is None:
        return None
    count = after.ttft_count - before.ttft_count
    if count <= 0:
        return None
    return (after.ttft_sum_s - before.ttft_sum_s) / count


def _cache_hit_delta(before: ServerSnapshot | None, after: ServerSnapshot | None) -> float | None:
    if before is None or after is None:
        return None
    if before.prefix_cache_hits_total is None or after.prefix_cache_hits_total is None:
        return None
    return after.prefix_cache_hits_total - before.prefix_cache_hits_total


def _expand(value: str, fields: dict) -> str:
    for key, replacement in fields.items():
        value = value.replace("{" + key + "}", replacement)
    return value


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


__all__ = ["LadderError", "RunDirError", "run_ladder", "schedule"]
