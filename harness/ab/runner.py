"""Runs a ladder: for each (arm, repeat) block a fresh serve (or the arm's own server), a baseline
scrape, then each step's prompt, streamed, with 1 s node sampling during it and a scrape after it.

The jobs live in their own modules: the order of blocks, resume and what follows a failed step
(schedule.py), one step (step.py), the arm's server within the run (lifecycle.py; the process itself
is serve.py), the status line (status.py), and the stages under them (config, prompts, client,
samplers, records). This one checks the run directory, builds each block's prompts, ties the parts
together, and makes sure every server it started is stopped, on success, on error and on Ctrl-C
(SIGTERM is treated the same).
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from harness.ab.client import RequestResult, Tokenizer
from harness.ab.config import Arm, Ladder, LadderError, Step, check_reachable
from harness.ab.lifecycle import ArmServer, expand
from harness.ab.prompts import Prompt, build_prompt, load_words
from harness.ab.records import (
    RESULTS_FILE,
    ArmStopped,
    PromptBuilt,
    Record,
    RecordWriter,
    RunEnd,
    RunStart,
    Scrape,
    ServeFailed,
    StepSkipped,
    of_type,
    read_records,
    unstopped_servers,
)
from harness.ab.redact import Redactor
from harness.ab.rundir import inside_run_dir, private_files
from harness.ab.samplers import Scraper
from harness.ab.schedule import Resume, run_block, schedule
from harness.ab.serve import ServeError, kill_stale
from harness.ab.status import Status
from harness.ab.step import StepRunner
from telemetry.errors import ConfigError
from telemetry.limits import MAX_PREFILL_TOKENS

# What --overwrite removes; the report's names as harness/ab/report writes them (compose.py, extras.py; a test
# holds them together), typed here so the runner does not load the report's numpy and matplotlib.
RUN_DIR_ENTRIES = (RESULTS_FILE, "report.md", "summary.json", "plots", "report-extras.json", "prompts", "logs",
                   "hook-logs")
REPO_ROOT = Path(__file__).resolve().parents[2]


class RunDirError(ConfigError):
    """The run directory cannot be used as asked (finished run without --overwrite, other ladder)."""


class StepTooLongError(LadderError):
    """A step's prompt does not fit the server's max_model_len (found from /v1/models before any request)."""


def environment() -> dict[str, Any]:
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
               console: Any = None) -> Path:
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
            names.append(expand(arm.serve.log_file, {**fields, "arm": arm.name}))
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
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Run:
    """One run: the blocks of the schedule, each through run_block with this object as its actions."""

    def __init__(self, ladder: Ladder, out_dir: Path, writer: RecordWriter, prior: list[Record], console: Any, *,
                 redactor: Redactor | None = None, child_umask: int = -1) -> None:
        from rich.console import Console

        self.redactor = redactor or Redactor.for_ladder(ladder)
        self.ladder = ladder
        self.out_dir = out_dir
        self.writer = writer
        self.prior = prior
        self.resume = Resume.from_records(prior)
        self.console = console or Console(stderr=True)
        self.status = Status()
        self.scraper = Scraper()
        self.http = httpx.Client(timeout=30.0)
        self.server = ArmServer(out_dir, writer, self.http, self.status, self.redactor, self.log,
                                model=ladder.model, child_umask=child_umask)
        self.steps = StepRunner(ladder, writer, self.scraper, self.http, self.status, self.log)
        self.prompts: dict[tuple[str, int], Prompt] = {}
        self.prompt_records = {(r.step, r.repeat): r for r in of_type(prior, PromptBuilt)}
        self.words = load_words(ladder.request.words_file) if ladder.request.words_file else None

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
                    run_block(self, self.ladder, self.resume, arm, repeat)
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

    # -- the actions of a block (harness/ab/schedule.py's BlockActions) --

    def write(self, record: Record) -> None:
        self.writer.write(record)

    def log(self, message: str) -> None:
        self.console.print(self.redactor.text(message), highlight=False, markup=False)

    def block_started(self, arm: Arm, repeat: int) -> None:
        self.status.arm, self.status.repeat, self.status.steps = arm.name, repeat, len(self.ladder.steps)

    def stop_server(self) -> None:
        self.server.stop()

    def server_alive(self, arm: Arm) -> bool:
        return self.server.alive(arm)

    def bring_up(self, arm: Arm, repeat: int, ranks: dict[str, Any], todo: list[Step]) -> bool:
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
                self.server.start(arm, repeat)
            max_model_len = self.server.info(arm, repeat, ranks)
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

    def run_step(self, arm: Arm, repeat: int, step: Step, ranks: dict[str, Any]) -> RequestResult:
        return self.steps.run(arm, repeat, step, ranks, self.prompts[(step.label, repeat)], self.model_name)

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
        model: str = response.json()["data"][0]["id"]
        return model

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


__all__ = ["LadderError", "RunDirError", "run_ladder", "schedule"]
