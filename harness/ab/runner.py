"""Runs a ladder: for each (arm, repeat) block a fresh serve (or the arm's own server), a baseline
scrape, then each step's prompt, streamed, with 1 s node sampling during it and a scrape after it.

The stages live in their own modules (config, prompts, client, serve, samplers, records); this one
only orders them, keeps the status line, and makes sure every server it started is stopped, on
success, on error and on Ctrl-C (SIGTERM is treated the same).

A block (a fresh serve, then the ladder's steps in order) is the unit of an A/B: a step's numbers
depend on what the same server did before it (a warm allocator reuses its segments). So `--resume`
skips finished blocks and runs an unfinished one again from its first step on a fresh server; its
earlier records stay in results.jsonl, marked by a `block_superseded` record, and no longer count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from harness.ab.client import RequestResult, Tokenizer, stream_request
from harness.ab.config import Arm, Ladder, LadderError, Step, check_reachable
from harness.ab.progress import LOG_INTERVAL_S, Rate, RequestProgress
from harness.ab.prompts import Prompt, answer_found, build_prompt, load_words
from harness.ab.records import (
    RESULTS_FILE,
    ArmStopped,
    BlockSuperseded,
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
    block_of,
    current_records,
    finished_steps,
    of_type,
    read_records,
    unstopped_servers,
)
from harness.ab.redact import Redactor, redact_argv, redact_env
from harness.ab.rundir import inside_run_dir, private_files
from harness.ab.samplers import NodeSampler, Scraper
from harness.ab.serve import ServedProcess, ServeError, kill_stale
from telemetry.errors import ConfigError
from telemetry.limits import MAX_PREFILL_TOKENS

RUN_DIR_ENTRIES = (RESULTS_FILE, "report.md", "summary.json", "plots", "prompts", "logs", "hook-logs")
REPO_ROOT = Path(__file__).resolve().parents[2]


class RunDirError(ConfigError):
    """The run directory cannot be used as asked (finished run without --overwrite, other ladder)."""


class StepTooLongError(LadderError):
    """A step's prompt does not fit the server's max_model_len (found from /v1/models before any request)."""


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
    """Run (or resume) the ladder into out_dir; returns the path of results.jsonl.

    Files and directories the run creates are private (0600 / 0700); secrets of the ladder never reach
    them nor the console (harness/ab/redact.py).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"--out {out_dir} is not a directory; expected a run directory (new, or of an earlier run)")
    results = out_dir / RESULTS_FILE
    redactor = Redactor.for_ladder(ladder)
    _check_paths(ladder, out_dir)
    prior: list[Record] = []
    holds_run = results.exists() and results.stat().st_size > 0
    if holds_run:
        if resume:
            prior = read_records(results)
            _check_same_ladder(prior, ladder, out_dir, redactor)
        elif not overwrite:
            raise RunDirError(f"{out_dir} already holds a run ({RESULTS_FILE}); pass --resume to finish it "
                              "or --overwrite to start over")
    # Best effort: an old run's unreadable records must not stop --overwrite from replacing it.
    for record in unstopped_servers(read_records(results, skip_unreadable=True) if holds_run else []):
        # A SIGKILLed harness (and watchdog) may have left its server behind: matched by identity.
        what = kill_stale(record.pid, record.pgid, record.start_time_ticks, record.boot_id, record.command)
        if what.startswith("stopped"):
            print(f"memtel ab: the server of {record.arm} repeat {record.repeat} that an earlier run left "
                  f"running (pid {record.pid}) was {what}", file=sys.stderr)
    try:
        check_reachable(ladder)  # before anything starts, and before --overwrite deletes anything
    except LadderError as exc:
        raise LadderError(redactor.text(str(exc))) from None
    if holds_run and overwrite and not resume:
        for name in RUN_DIR_ENTRIES:
            path = out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    with private_files() as user_umask:
        out_dir.mkdir(parents=True, exist_ok=True)
        writer = RecordWriter(results, redact=redactor.value)
        try:
            with _sigterm_as_interrupt():
                _Run(ladder, out_dir, writer, prior, console, redactor=redactor, child_umask=user_umask).execute()
        finally:
            writer.close()
    return results


def _check_paths(ladder: Ladder, out_dir: Path) -> None:
    """Every path the run writes must resolve inside out_dir (a symbolic link planted in it is refused)."""
    names = ["prompts", "logs", "hook-logs", RESULTS_FILE,
             *(f"prompts/{step.label}-r0.txt" for step in ladder.steps)]
    fields = {"run_dir": str(out_dir.resolve()), "repeat": "0"}
    for arm in ladder.arms:
        names += [f"logs/{arm.name}-r0-serve.log", f"hook-logs/{arm.name}-r0"]
        if arm.serve is not None and arm.serve.log_file:
            names.append(_expand(arm.serve.log_file, {**fields, "arm": arm.name}))
    for name in names:
        inside_run_dir(out_dir, name, what=f"{ladder.source}: the run's")


def _check_same_ladder(prior: list[Record], ladder: Ladder, out_dir: Path, redactor: Redactor) -> None:
    starts = of_type(prior, RunStart)
    if not starts:
        return
    # Compared as recorded: secrets are redacted in the record (a rotated token does not block a resume).
    before = json.loads(json.dumps(redactor.ladder(starts[0].ladder).to_dict()))
    now = json.loads(json.dumps(redactor.ladder(ladder).to_dict()))
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
    progress: RequestProgress | None = None  # the request in flight
    run_started: float = dataclasses.field(default_factory=time.monotonic)

    def render(self):
        from rich.text import Text

        now = time.monotonic()
        progress = self.progress
        if progress is not None:
            during = progress.text()
        else:
            during = f"step {now - self.step_started if self.step_started else 0.0:,.0f} s"
        ttft = f"{self.last_ttft:.2f} s" if self.last_ttft is not None else "-"
        return Text.assemble(
            ("memtel ab ", "bold"), (f"{self.arm}", "cyan"), f" repeat {self.repeat} ",
            (f"{self.step}", "magenta"), f" ({self.step_index}/{self.steps}) ",
            f"{self.tokens:,} tokens · {self.phase} · {during} · run {now - self.run_started:,.0f} s",
            f" · last TTFT {ttft}",
        )


class _Run:
    def __init__(self, ladder: Ladder, out_dir: Path, writer: RecordWriter, prior: list[Record], console, *,
                 redactor: Redactor | None = None, child_umask: int = -1) -> None:
        from rich.console import Console

        self.redactor = redactor or Redactor.for_ladder(ladder)
        self.child_umask = child_umask  # the served commands keep the user's umask
        self.ladder = ladder
        self.out_dir = out_dir
        self.writer = writer
        self.prior = prior
        self.done = finished_steps(prior)
        # Blocks with records that count (a serve, a request...): resuming one supersedes them.
        self.started_blocks = {b for r in current_records(prior) if (b := block_of(r)) is not None}
        self.console = console or Console(stderr=True)
        self.status = _Status()
        self.scraper = Scraper()
        self.http = httpx.Client(timeout=30.0)
        self.prompts: dict[tuple[str, int], Prompt] = {}
        self.prompt_records = {(r.step, r.repeat): r for r in of_type(prior, PromptBuilt)}
        self.server: ServedProcess | None = None
        self.words = load_words(ladder.request.words_file) if ladder.request.words_file else None
        self.last_rate: dict[tuple[str, int], Rate] = {}  # (arm, repeat) -> its last request's tokens/s

    # -- top level --

    def execute(self) -> None:
        from rich.live import Live

        from telemetry.safefs import read_capped
        from telemetry.safeyaml import MAX_CONFIG_BYTES

        source_text = None
        with contextlib.suppress(OSError, UnicodeDecodeError):
            source_text = self.redactor.yaml_text(
                read_capped(self.ladder.source, MAX_CONFIG_BYTES, follow_symlinks=True).decode())
        self.writer.write(RunStart(resumed=bool(self.prior), ladder=self.redactor.ladder(self.ladder),
                                   ladder_source=self.ladder.source, ladder_text=source_text,
                                   environment=environment()))
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
            usage = resource.getrusage(resource.RUSAGE_SELF)
            # ru_maxrss is in KiB on Linux.
            self.writer.write(RunEnd(status=status, cpu_s=usage.ru_utime + usage.ru_stime,
                                     max_rss_bytes=usage.ru_maxrss * 1024))
            self.scraper.close()
            self.http.close()

    def log(self, message: str) -> None:
        self.console.print(self.redactor.text(message), highlight=False, markup=False)

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
        log_path = inside_run_dir(self.out_dir, log_name, what=f"arms {arm.name}: serve.log_file")
        self.status.phase = "starting server"
        shown = self.redactor.value(redact_argv(spec.command))
        server = ServedProcess(spec, log_path, extra_env=extra_env, shown_command=shown, umask=self.child_umask)
        server.start()
        self.server = server
        assert server.pid is not None
        self.writer.write(ServeStart(arm=arm.name, repeat=repeat, command=shown,
                                     env=redact_env({**extra_env, **spec.env}),  # expanded, and what was added
                                     cwd=spec.cwd, pid=server.pid, pgid=server.pid, log=self.relative(log_path),
                                     hook_log_dir=self.relative(Path(hook_log_dir)) if hook_log_dir else None,
                                     start_time_ticks=server.info.start_time_ticks if server.info else None,
                                     boot_id=server.boot_id))
        seconds = server.wait_healthy()
        self.writer.write(ServeReady(arm=arm.name, repeat=repeat, pgid=server.pid, startup_s=seconds))
        self.log(f"[{arm.name} repeat {repeat}] server ready in {seconds:.1f} s (pid {server.pid})")

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

    def server_info(self, arm: Arm, repeat: int, ranks: dict) -> int | None:
        """Record the server's /version, /v1/models and which rank exporters answer; its max_model_len."""
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
            self.log(f"[{arm.name} repeat {repeat}] warning: rank {name} not reachable ({error})")
        return _max_model_len(info["models"], self.ladder.model)

    def check_lengths(self, arm: Arm, max_model_len: int | None) -> None:
        """Every step's prompt must be shorter than the server's max_model_len (vLLM refuses the rest)."""
        if max_model_len is None:
            return
        for i, step in enumerate(self.ladder.steps):
            if step.tokens >= max_model_len:
                raise StepTooLongError(
                    f"{self.ladder.source}: steps[{i}] ({step.label}): {step.tokens:,} tokens do not fit arm "
                    f"{arm.name}'s server, whose max_model_len is {max_model_len:,} ({arm.url}/v1/models); a "
                    f"prompt must be shorter than max_model_len: serve with a larger one or shorten the step")

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
        path = inside_run_dir(self.out_dir, f"prompts/{step.label}-r{repeat}.txt", what="the prompt file")
        stored = self.prompt_records.get(key)
        text = _read_prompt(path) if stored is not None else None
        if stored is not None and text is not None:
            prompt = Prompt(text=text, prompt_tokens=stored.prompt_tokens, needle=stored.needle,
                            answer=stored.answer, question=stored.question, seed=step.seed, repeat=repeat,
                            tokenize_calls=0, filler_words=stored.filler_words, pad_words=stored.pad_words)
            if prompt.sha256 == stored.sha256:
                self.prompts[key] = prompt
                return prompt
        self.status.phase = f"building the {step.tokens:,}-token prompt of {step.label}"
        tokenizer = Tokenizer(self.http, arm.url, self.model_name(arm), api=self.ladder.request.api)
        started = time.perf_counter()
        prompt = build_prompt(step.tokens, step.seed, tokenizer.count, repeat=repeat,
                              needle_depth=self.ladder.request.needle_depth, words=self.words)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_private(path, prompt.text.encode())
        self.writer.write(PromptBuilt(
            step=step.label, repeat=repeat, seed=step.seed, target_tokens=step.tokens,
            prompt_tokens=prompt.prompt_tokens, tokenize_calls=prompt.tokenize_calls,
            build_s=time.perf_counter() - started, sha256=prompt.sha256, path=str(path.relative_to(self.out_dir)),
            needle=prompt.needle, answer=prompt.answer, question=prompt.question, filler_words=prompt.filler_words,
            pad_words=prompt.pad_words, built_with=arm.name, max_model_len=tokenizer.max_model_len,
            tokenize_s=tokenizer.seconds))
        self.prompts[key] = prompt
        return prompt

    # -- one block: an arm's ladder for one repeat --

    def run_block(self, arm: Arm, repeat: int) -> None:
        steps = list(self.ladder.steps)
        finished = [s.label for s in steps if (arm.name, repeat, s.label) in self.done]
        if len(finished) == len(steps):
            return
        if (arm.name, repeat) in self.started_blocks:
            self.supersede(arm, repeat, finished)
        todo = steps
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
                        self.log(f"[{arm.name} repeat {repeat}] server died; starting a fresh one for the rest")
                        self.stop_server()
                        if self.bring_up(arm, repeat, ranks, rest):
                            continue
                        return
                reason = ("server died" if not alive else "request failed") + f" at step {step.label}: {result.error}"
                self.stop_arm(arm, repeat, rest, reason)
                return
        finally:
            self.stop_server()

    def supersede(self, arm: Arm, repeat: int, finished: list[str]) -> None:
        """An unfinished block runs again from its first step: its earlier records stop counting."""
        fresh = "on a fresh server" if arm.serve is not None else \
            f"on the same external server ({arm.url}: not restarted, so not necessarily cold)"
        reason = (f"resumed: the block had not finished ({len(finished)} of {len(self.ladder.steps)} steps done); "
                  f"it runs again from its first step {fresh}")
        self.writer.write(BlockSuperseded(arm=arm.name, repeat=repeat, steps=finished, reason=reason))
        self.done -= {(arm.name, repeat, s.label) for s in self.ladder.steps}
        self.started_blocks.discard((arm.name, repeat))
        self.log(f"[{arm.name} repeat {repeat}] {reason}; the earlier records stay in {RESULTS_FILE}, superseded")

    def bring_up(self, arm: Arm, repeat: int, ranks: dict, todo: list[Step]) -> bool:
        """Start the arm's server if it is served, note its versions, check every step fits, build prompts,
        scrape the baseline."""
        def could_not_start(exc: Exception) -> bool:
            if isinstance(exc, ServeError):
                self.writer.write(ServeFailed(arm=arm.name, repeat=repeat, error=str(exc)))
            self.stop_server()
            self.stop_arm(arm, repeat, todo, f"could not start: {type(exc).__name__}: {exc}")
            return False

        try:
            if arm.serve is not None:
                self.start_server(arm, repeat)
            max_model_len = self.server_info(arm, repeat, ranks)
        except (ServeError, httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
            return could_not_start(exc)
        self.check_lengths(arm, max_model_len)  # a bad ladder: the run stops here, before any request
        try:
            for step in todo:
                self.prompt_for(step, repeat, arm)
        except (ServeError, httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
            return could_not_start(exc)
        self.status.phase = "baseline scrape"
        snap = self.scraper.all(self.ladder.nodes, ranks, arm.url)
        self.writer.write(Scrape(phase="baseline", arm=arm.name, repeat=repeat, step=None, nodes=snap.nodes,
                                 ranks=snap.ranks, server=snap.server))
        return True

    def stop_arm(self, arm: Arm, repeat: int, rest: list[Step], reason: str) -> None:
        self.writer.write(ArmStopped(arm=arm.name, repeat=repeat, reason=reason))
        for step in rest:
            self.writer.write(StepSkipped(arm=arm.name, repeat=repeat, step=step.label, reason=reason))
        self.log(f"[{arm.name} repeat {repeat}] arm stopped: {reason}")

    def run_step(self, arm: Arm, repeat: int, step: Step, ranks: dict) -> RequestResult:
        prompt = self.prompts[(step.label, repeat)]
        self.status.step, self.status.tokens = step.label, prompt.prompt_tokens
        self.status.step_index = [s.label for s in self.ladder.steps].index(step.label) + 1
        before = self.scraper.server(arm.url)

        def on_sample(node: str, snap: NodeSnapshot) -> None:
            self.writer.write(NodeSample(arm=arm.name, repeat=repeat, step=step.label, node=node, snapshot=snap))

        self.status.phase = "prefill + decode"
        self.status.step_started = time.monotonic()
        settings = dataclasses.replace(self.ladder.request, timeout_s=self.ladder.timeout_for(step))
        progress = RequestProgress(prompt.prompt_tokens, self.last_rate.get((arm.name, repeat)), ranks)
        with NodeSampler(self.ladder.nodes, self.ladder.sample_interval_s, on_sample) as sampler, progress, \
                self.progress_lines(f"[{arm.name} repeat {repeat}] {step.label}", progress):
            self.status.progress = progress
            try:
                result = stream_request(self.http, arm.url, self.model_name(arm), prompt.text, settings)
            finally:
                self.status.progress = None
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
            if result.ttft_s:
                self.last_rate[(arm.name, repeat)] = Rate(step.label, prompt.prompt_tokens / result.ttft_s)
            self.log(f"[{arm.name} repeat {repeat}] {step.label}: {prompt.prompt_tokens:,} tokens, "
                     f"TTFT {result.ttft_s or 0:.3f} s "
                     f"(server {server_ttft if server_ttft is None else round(server_ttft, 3)} s), "
                     f"e2e {result.e2e_s:.2f} s, {result.output_tokens} output tokens")
        else:
            self.log(f"[{arm.name} repeat {repeat}] {step.label}: FAILED: {result.error}")
        return result

    @contextlib.contextmanager
    def progress_lines(self, what: str, progress: RequestProgress):
        """A progress line in the console log every LOG_INTERVAL_S while a request runs (CI logs, no terminal)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(LOG_INTERVAL_S):
                self.log(f"{what}: {progress.text()} (no first token yet, or decoding)")

        thread = threading.Thread(target=loop, name="memtel-progress-lines", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)


def _max_model_len(models: object, model: str) -> int | None:
    """max_model_len of the served model from /v1/models (vLLM's shape: data[i].max_model_len)."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    cards = [c for c in models["data"] if isinstance(c, dict)]
    card = next((c for c in cards if c.get("id") == model), cards[0] if cards else None)
    value = card.get("max_model_len") if card else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _read_prompt(path: Path) -> str | None:
    """A prompt saved by an earlier run (its SHA-256 is checked by the caller), or None: build it again."""
    from telemetry.safefs import read_capped

    try:
        return read_capped(path, 16 * MAX_PREFILL_TOKENS).decode()  # no symlink followed; bounded
    except (OSError, UnicodeDecodeError):
        return None


def _write_private(path: Path, data: bytes) -> None:
    """Write `path` 0600, never through a symbolic link planted in its place."""
    from telemetry.safefs import open_private, write_all

    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


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
