"""The lab server's API, through the harness's client and through the `openai` package."""

from __future__ import annotations

import json

import httpx
import pytest

from harness.ab.client import Tokenizer, stream_request
from harness.ab.config import RequestSettings
from harness.ab.prompts import build_prompt
from tests.support.prom import metric

MODEL = "lab-stock"


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_models_tokenize_and_health(lab_server):
    models = httpx.get(lab_server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 16384
    body = httpx.post(lab_server.url + "/tokenize", json={"model": MODEL, "prompt": "one two  three\nfour"}).json()
    assert body["count"] == 4 and len(body["tokens"]) == 4 and body["max_model_len"] == 16384
    assert body["tokens"][0] != body["tokens"][1]
    again = httpx.post(lab_server.url + "/tokenize", json={"prompt": "one two"}).json()
    assert again["tokens"] == body["tokens"][:2]  # the same word is the same id
    assert httpx.get(lab_server.url + "/health").status_code == 200
    assert "memtel-lab" in httpx.get(lab_server.url + "/version").json()["version"]


def test_harness_client_streams_an_exact_prompt(lab_server):
    with httpx.Client() as client:
        tokenizer = Tokenizer(client, lab_server.url, MODEL)
        prompt = build_prompt(3000, seed=11, count_tokens=tokenizer.count)
        assert prompt.prompt_tokens == 3000 and tokenizer.calls <= 3
        before = metric(lab_server.url + "/metrics", "vllm:time_to_first_token_seconds_count")
        result = stream_request(client, lab_server.url, MODEL, prompt.text, RequestSettings(max_tokens=5, timeout_s=60))
    assert result.ok, result.error
    assert result.usage_prompt_tokens == 3000 and result.output_tokens == 5
    assert result.content_chunks == 5 and result.finish_reason == "length"
    assert result.ttft_s is not None and result.e2e_s is not None and result.ttft_s <= result.e2e_s
    after = metric(lab_server.url + "/metrics", "vllm:time_to_first_token_seconds_count")
    assert after == (before or 0) + 1
    # Every rank ran the prefill through the hooked indexer: 3 chunk steps x 4 layers, 1 launch each
    # below the budget (1024 rows x kv <= 768 x 4 B < 4 MiB); plus the one empty warm-up launch.
    for rank in range(lab_server.ranks):
        calls = metric(lab_server.rank_url(rank), "memtel_hook_calls_total")
        assert calls is not None and calls >= 1 + 3 * 4


def test_openai_client_completions(lab_server):
    import openai  # the independent client; scripts/test installs it (the test extra)

    client = openai.OpenAI(base_url=lab_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        completion = client.completions.create(model=MODEL, prompt=words(700, "oa"), max_tokens=3, temperature=0)
        assert completion.usage is not None
        assert completion.usage.prompt_tokens == 700 and completion.usage.completion_tokens == 3
        assert completion.choices[0].finish_reason == "length" and completion.choices[0].text.split()
        stream = client.completions.create(model=MODEL, prompt=words(300, "os"), max_tokens=4, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert len(texts) == 4
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == 300 and usage.total_tokens == 304
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words(50, "c")}],
                                              max_tokens=2)
        assert chat.usage is not None and chat.usage.prompt_tokens == 50 and chat.choices[0].message.content
        assert [m.id for m in client.models.list().data] == [MODEL]
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt=words(16385, "x"), max_tokens=1)
        assert "maximum context length is 16384 tokens" in str(error.value)
    finally:
        client.close()


@pytest.mark.parametrize("body, expected", [
    (b"{not json", "malformed JSON"),
    (b"", "body is empty"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"model": MODEL, "prompt": "a b", "max_tokens": 0}).encode(), "max_tokens must be an integer >= 1"),
    (json.dumps({"model": MODEL, "prompt": "a b", "max_tokens": "5"}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL}).encode(), "`prompt` is required"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), "cannot be empty"),
    (json.dumps({"model": MODEL, "prompt": {"a": 1}}).encode(), "`prompt` must be"),
    (json.dumps({"model": MODEL, "prompt": "a", "stream": "yes"}).encode(), "stream must be true or false"),
    (json.dumps({"model": MODEL, "prompt": "a " * 16384}).encode(), "leaves no room for any output tokens"),
    (json.dumps({"model": MODEL, "prompt": "a " * 16385}).encode(), "contains 16385 input tokens"),
])
def test_bad_requests_get_vllm_shaped_400s(lab_server, body, expected):
    response = httpx.post(lab_server.url + "/v1/completions", content=body,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["object"] == "error" and error["type"] == "BadRequestError" and error["code"] == 400
    assert expected in error["message"]
    assert error["error"]["message"] == error["message"]  # newer vLLM's nested shape as well


def test_unknown_model_and_route(lab_server):
    response = httpx.post(lab_server.url + "/v1/completions", json={"model": "other", "prompt": "a"})
    assert response.status_code == 404 and "`other` does not exist" in response.json()["message"]
    assert httpx.get(lab_server.url + "/v2/nothing").status_code == 404
    # The server is still fine after bad requests.
    ok = httpx.post(lab_server.url + "/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 3


def test_metrics_are_named_like_vllms(lab_server):
    base = lab_server.url + "/metrics"
    prompt_before = metric(base, "vllm:prompt_tokens_total") or 0
    gen_before = metric(base, "vllm:generation_tokens_total") or 0
    response = httpx.post(lab_server.url + "/v1/completions", json={"prompt": words(123, "m"), "max_tokens": 2})
    assert response.status_code == 200
    assert metric(base, "vllm:prompt_tokens_total") == prompt_before + 123
    assert metric(base, "vllm:generation_tokens_total") == gen_before + 2
    text = httpx.get(base).text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="lab-stock"}' in text
    assert "_created" not in text
