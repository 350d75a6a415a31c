"""The OpenAI Python client against a real `memtel guard` in front of a real lab node (`memtel lab serve`).

The node of `memtel demo --guard` (1.5 GiB, max-model-len 1,100,000, the limit about 401,244 at rest): a
prompt over max-model-len is a permanent BadRequestError at once, with the client's default retries; one
within what the node takes at best but over the limit now (another tenant holds part of the node) is a
transient 503 the client would retry.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from harness.demo.guarded import guard_limit, prompt_text, tenant_holds
from tests.guard.test_lab_guard import Node, scrape, wait_until

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1_100_000


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    node = Node(tmp_path_factory.mktemp("lab-openai"))
    try:
        node.start()
        url, metrics = node.guard()
        yield node, url, metrics
    finally:
        node.stop()


def test_the_openai_client_gets_a_permanent_bad_request_from_the_lab_guard_without_retrying(lab):
    node, url, metrics = lab
    prompt = prompt_text(MAX_MODEL_LEN + 100_000, seed=11)
    prompt_tokens_before = node.metric("vllm:prompt_tokens_total")
    started = time.perf_counter()
    with openai.OpenAI(base_url=url + "/v1", api_key="k") as client, \
            pytest.raises(openai.BadRequestError) as caught:  # default max_retries=2
        client.completions.create(model="lab", prompt=prompt, max_tokens=4)
    assert time.perf_counter() - started < 1.0
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["max_model_len"] == MAX_MODEL_LEN  # read from the lab's /v1/models
    # One call, one refusal: the client did not retry (the review's 503 was counted three times).
    assert scrape(f"http://127.0.0.1:{metrics}/metrics")["memtel_guard_rejected_total"] == 1.0
    assert node.metric("vllm:prompt_tokens_total") == prompt_tokens_before and node.healthy()


def test_the_openai_client_gets_a_transient_503_for_a_prompt_within_what_the_node_takes_at_best(lab):
    node, _url, metrics = lab
    wait_until(lambda: "memtel_guard_limit_tokens_at_best" in scrape(f"http://127.0.0.1:{metrics}/metrics"), 30,
               "the at-best limit, read before the tenant comes")
    at_once, at_once_metrics = node.guard("--queue-s", "0")   # the queue off: the 503 at once, not at its end
    tenant_holds(node.url, 0.9)   # another process holds 0.9 of the node's 1.5 GiB for a while
    try:
        wait_until(lambda: (guard_limit(at_once_metrics) or 10**9) < 300_000, 30, "the limit to fall with the tenant")
        with openai.OpenAI(base_url=at_once + "/v1", api_key="k", max_retries=0) as client, \
                pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="lab", prompt=prompt_text(300_000, seed=12), max_tokens=4)
    finally:
        tenant_holds(node.url, 0)
    response = caught.value.response
    assert response.status_code == 503 and response.headers["x-should-retry"] == "true"
    assert response.headers["retry-after"] == "10" and node.healthy()
    assert caught.value.body["limit_at_best_from"] == "memory" and caught.value.body["limit_tokens_at_best"] > 300_000


def test_a_burst_the_engine_serves_one_prefill_at_a_time_completes_through_the_guard_with_no_flags(lab):
    """The issue's burst: 16 concurrent 100k-word prompts through the OpenAI SDK (its defaults), the guard as the
    quick start runs it (no --queue-s): each waits its turn in the default queue instead of a 503."""
    node, url, _metrics = lab
    prompts = [prompt_text(100_000, seed=20 + i) for i in range(16)]
    done: list[int] = []
    failed: list[str] = []

    def one(prompt: str) -> None:
        try:
            with openai.OpenAI(base_url=url + "/v1", api_key="k") as client:
                answer = client.completions.create(model="lab", prompt=prompt, max_tokens=4)
            done.append(answer.usage.prompt_tokens if answer.usage else 0)
        except openai.OpenAIError as exc:
            failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failed == [] and len(done) == 16 and all(tokens >= 100_000 for tokens in done)
    assert node.healthy() and node.out_of_memory_lines() == []
