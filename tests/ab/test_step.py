"""harness/ab/step.py without servers: the client talks to an httpx.MockTransport, the scraper and the record
writer are fakes. (The real runs are tests/ab/test_lab_ladder.py and tests/ab/test_vllm_ladder.py.)"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from harness.ab.config import Arm, Ladder, RequestSettings, Step
from harness.ab.prompts import Prompt
from harness.ab.records import RequestDone, Scrape, ServerSnapshot
from harness.ab.samplers import ScrapeSet
from harness.ab.status import Status
from harness.ab.step import StepRunner, cache_hit_delta, server_ttft

URL = "http://127.0.0.1:9"
STEP = Step("s1", 1000, 1)
PROMPT = Prompt(text="filler. The code is 42. What is the code?", prompt_tokens=1000, needle="The code is 42.",
                answer="42", question="What is the code?", seed=1, repeat=0, tokenize_calls=1, filler_words=1,
                pad_words=0)


class Records:
    def __init__(self) -> None:
        self.records: list[Any] = []

    def write(self, record: Any) -> Any:
        self.records.append(record)
        return record


class FakeScraper:
    """The server's TTFT histogram and prefix-cache counter, before and after the one request."""

    def __init__(self) -> None:
        self.before = ServerSnapshot(ttft_sum_s=10.0, ttft_count=4, prefix_cache_hits_total=100)
        self.after = ServerSnapshot(ttft_sum_s=10.5, ttft_count=5, prefix_cache_hits_total=164)

    def server(self, base_url: str) -> ServerSnapshot:
        return self.before

    def all(self, nodes: dict[str, str], ranks: dict[str, str], server_url: str | None) -> ScrapeSet:
        return ScrapeSet(nodes={}, ranks={}, server=self.after)


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def completions(handler_body: bytes, status: int = 200) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        sent = json.loads(request.content)
        assert sent["model"] == "m" and sent["prompt"] == PROMPT.text
        return httpx.Response(status, content=handler_body)

    return httpx.Client(transport=httpx.MockTransport(handle))


def ladder() -> Ladder:
    return Ladder(model="m", arms=(Arm("a", URL),), steps=(STEP,), request=RequestSettings(max_tokens=4))


def run_one(client: httpx.Client) -> tuple[Any, list[Any], Status, StepRunner]:
    records, status, logs = Records(), Status(), []
    runner = StepRunner(ladder(), records, FakeScraper(), client, status, logs.append)  # type: ignore[arg-type]
    result = runner.run(ladder().arms[0], 0, STEP, {}, PROMPT, lambda arm: "m")
    return result, records.records, status, runner


def test_a_step_records_the_request_with_the_servers_own_ttft_and_cache_hits_then_the_after_scrape():
    body = sse({"choices": [{"text": " 42", "finish_reason": None}]},
               {"choices": [{"text": "", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1000, "completion_tokens": 4}})
    result, records, status, runner = run_one(completions(body))
    assert result.ok and [type(r) for r in records] == [RequestDone, Scrape]
    done = records[0]
    assert done.server_ttft_s == pytest.approx(0.5) and done.prefix_cache_hit_tokens == 64
    assert done.prompt_tokens_match is True and done.needle_found is True and done.output_tokens == 4
    assert done.reply == " 42" and done.target_tokens == 1000 and done.seed == 1
    assert records[1].phase == "after" and records[1].step == "s1"
    assert status.step == "s1" and status.step_index == 1 and status.progress is None
    assert runner.last_rate[("a", 0)].step == "s1"


def test_a_failed_request_is_recorded_not_raised_and_sets_no_rate():
    result, records, _, runner = run_one(completions(b"overloaded", status=503))
    assert not result.ok and records[0].ok is False and records[0].error == "HTTP 503: overloaded"
    assert records[0].needle_found is None and runner.last_rate == {}


def test_server_ttft_and_cache_hits_need_both_scrapes_and_a_new_observation():
    before = ServerSnapshot(ttft_sum_s=1.0, ttft_count=1, prefix_cache_hits_total=5)
    assert server_ttft(before, before) is None  # no request observed in between
    assert server_ttft(before, ServerSnapshot(error="refused")) is None
    assert server_ttft(None, before) is None and cache_hit_delta(before, None) is None
    assert cache_hit_delta(ServerSnapshot(), before) is None  # a series the server does not export: unknown
