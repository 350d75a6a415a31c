"""One step of a block: its prompt sent to the arm's server, streamed, with the nodes sampled during it,
the server and ranks scraped before and after, and one request_done and one `after` scrape recorded.

A request never raises mid-run for a server's fault: the client returns a failed RequestResult, which is
recorded and returned; what happens next is the schedule's call (harness/ab/schedule.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from harness.ab.client import RequestResult, stream_request
from harness.ab.config import Arm, Ladder, Step
from harness.ab.progress import LOG_INTERVAL_S, Rate, RequestProgress
from harness.ab.prompts import Prompt, answer_found
from harness.ab.records import NodeSample, NodeSnapshot, RecordWriter, RequestDone, Scrape, ServerSnapshot
from harness.ab.samplers import NodeSampler, Scraper
from harness.ab.status import Status


def server_ttft(before: ServerSnapshot | None, after: ServerSnapshot | None) -> float | None:
    """The server's own TTFT for the one request between two scrapes (sum/count deltas)."""
    if before is None or after is None or before.error or after.error:
        return None
    if before.ttft_sum_s is None or after.ttft_sum_s is None or before.ttft_count is None or after.ttft_count is None:
        return None
    count = after.ttft_count - before.ttft_count
    if count <= 0:
        return None
    return (after.ttft_sum_s - before.ttft_sum_s) / count


def cache_hit_delta(before: ServerSnapshot | None, after: ServerSnapshot | None) -> float | None:
    """Prefix-cache hit tokens between two scrapes (the one request's)."""
    if before is None or after is None:
        return None
    if before.prefix_cache_hits_total is None or after.prefix_cache_hits_total is None:
        return None
    return after.prefix_cache_hits_total - before.prefix_cache_hits_total


class StepRunner:
    """Runs steps against the arm's server; keeps each block's last rate for the next step's progress line."""

    def __init__(self, ladder: Ladder, writer: RecordWriter, scraper: Scraper, http: httpx.Client, status: Status,
                 log: Callable[[str], None]) -> None:
        self.ladder = ladder
        self.writer = writer
        self.scraper = scraper
        self.http = http
        self.status = status
        self.log = log
        self.last_rate: dict[tuple[str, int], Rate] = {}  # (arm, repeat) -> its last request's tokens/s

    def run(self, arm: Arm, repeat: int, step: Step, ranks: dict[str, Any], prompt: Prompt,
            model_name: Callable[[Arm], str]) -> RequestResult:
        """Send the step's prompt and record it; `model_name(arm)` names the model in the request."""
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
                result = stream_request(self.http, arm.url, model_name(arm), prompt.text, settings)
            finally:
                self.status.progress = None
        self.status.phase = "scraping"
        after = self.scraper.all(self.ladder.nodes, ranks, arm.url)
        ttft_on_server = server_ttft(before, after.server)
        cache_hits = cache_hit_delta(before, after.server)
        needle = answer_found(prompt.answer, result.text) if self.ladder.request.check_answer and result.ok else None
        usage = result.usage_prompt_tokens
        self.writer.write(RequestDone(
            arm=arm.name, repeat=repeat, step=step.label, seed=step.seed, target_tokens=step.tokens,
            prompt_tokens=prompt.prompt_tokens, prompt_sha256=prompt.sha256, usage_prompt_tokens=usage,
            prompt_tokens_match=(usage == prompt.prompt_tokens) if usage is not None else None,
            ok=result.ok, error=result.error, status_code=result.status_code, started_at=result.started_at,
            ended_at=result.ended_at, ttft_s=result.ttft_s, e2e_s=result.e2e_s, server_ttft_s=ttft_on_server,
            output_tokens=result.output_tokens, content_chunks=result.content_chunks,
            finish_reason=result.finish_reason, prefix_cache_hit_tokens=cache_hits, needle_found=needle,
            answer=prompt.answer, reply=result.text[:500], min_mem_available_bytes=sampler.min_mem_available,
            max_swap_used_bytes=sampler.max_swap_used, node_samples=sampler.samples))
        self.writer.write(Scrape(phase="after", arm=arm.name, repeat=repeat, step=step.label, nodes=after.nodes,
                                 ranks=after.ranks, server=after.server))
        self.status.last_ttft = result.ttft_s
        if result.ok:
            if result.ttft_s:
                self.last_rate[(arm.name, repeat)] = Rate(step.label, prompt.prompt_tokens / result.ttft_s)
            self.log(f"[{arm.name} repeat {repeat}] {step.label}: {prompt.prompt_tokens:,} tokens, "
                     f"TTFT {result.ttft_s or 0:.3f} s "
                     f"(server {ttft_on_server if ttft_on_server is None else round(ttft_on_server, 3)} s), "
                     f"e2e {result.e2e_s:.2f} s, {result.output_tokens} output tokens")
        else:
            self.log(f"[{arm.name} repeat {repeat}] {step.label}: FAILED: {result.error}")
        return result

    @contextlib.contextmanager
    def progress_lines(self, what: str, progress: RequestProgress) -> Iterator[None]:
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


__all__ = ["StepRunner", "cache_hit_delta", "server_ttft"]
