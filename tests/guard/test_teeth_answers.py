"""Teeth for what the guard reads and says (issue 30's mutation testing): the engines' flags and file refused in
one line that names the flag, the replica and what it holds (telemetry/guard/replicas.py); a chat prompt's size
(prompt.py); the bodies of two refusals as a client reads them and which refusals a wait can cure (refusal.py,
queue.py); the limit with no reserve asked for (limit.py), and what a guard that has read no hook yet reports
(proxy.py, metrics.py). Pure, in-process."""

from __future__ import annotations

import time

import pytest

from telemetry.catalogue.fields import GUARD_BAD_REQUEST, GUARD_WOULD_NOT_FIT
from telemetry.errors import ConfigError
from telemetry.guard.limit import Limit, LimitTracker, RankFit
from telemetry.guard.metrics import GuardMetrics, guard_registry
from telemetry.guard.prompt import CHAT_COMPLETIONS, COMPLETIONS, PromptError, PromptSize, measure
from telemetry.guard.proxy import GuardProxy
from telemetry.guard.refusal import behind, uncountable
from telemetry.guard.replicas import engines, hook_targets, replica_flag, replicas_file
from telemetry.url import parse_base_url, parse_url

LONG = "http://" + "h" * 100   # a URL past the 80 characters an error line quotes


def message(call, *args) -> str:
    with pytest.raises(ConfigError) as error:
        call(*args)
    return str(error.value)


def test_the_hook_list_is_named_by_its_flag():
    assert message(hook_targets, LONG + ",,x") == \
        f"--hooks: {(LONG + ',,x')[:80]!r}: expected one or more hook URLs separated by commas"
    assert message(hook_targets, "ftp://h:1", "--replica").startswith("--replica: ")


def test_a_replica_flag_without_its_hooks_is_quoted_to_80_characters():
    assert message(replica_flag, LONG) == \
        f"--replica: {LONG[:80]!r}: expected URL=HOOK[,HOOK...], e.g. http://10.0.0.1:8000=http://10.0.0.1:9200"


def test_no_engine_at_all_says_both_forms():
    assert message(engines, None, None, None, None) == \
        "--upstream URL with --hooks URL[,URL...] (one engine), or --replica / --replicas (several): none given"


@pytest.mark.parametrize("text, said", [
    ("replicas:\n", "`replicas` is empty; expected `replicas:`"),
    ("replicas: [x]\n", "replica 1 has a str; expected exactly the keys upstream and hooks"),
    ("replicas: [{}]\n", "replica 1 has nothing; expected exactly the keys upstream and hooks"),
    ("replicas: [{upstream: 5, hooks: [http://h:1]}]\n", "replica 1: upstream is a int; expected the engine's base "
                                                         "URL"),
    ("replicas: [{upstream: 'http://u:1', hooks: ['ftp://h:1']}]\n", "replica 1: "),
])
def test_a_bad_replicas_file_names_the_file_and_the_replica(tmp_path, text, said):
    path = tmp_path / "replicas.yaml"
    path.write_text(text)
    assert message(replicas_file, path).startswith(f"--replicas {path}: {said}")


def test_a_chat_prompt_is_sized_as_messages_by_its_text_parts():
    size = measure(CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": [{"text": "hello there"}]}]})
    assert size.param == "messages" and size.exact is False
    assert size.texts == (b"hello there",) and size.engine_only is None   # a part with `text` and no `type`


def test_prompt_embeds_that_are_not_base64_strings_are_refused():
    with pytest.raises(PromptError) as error:
        measure(COMPLETIONS, {"prompt_embeds": []})
    assert str(error.value) == "`prompt_embeds` must be a base64 string or a non-empty list of them"


FIT = RankFit("0", "node-a", 1000, 8 << 30, None)
LIMIT = Limit(600, 1000, 400, FIT, "http://node-a:9200")


def test_waiting_behind_another_is_a_transient_refusal_naming_the_prompt_and_the_limit():
    refusal = behind(700, "words", LIMIT)
    error = refusal.body["error"]
    assert str(refusal) == error["message"]
    assert error == {"message": error["message"], "type": GUARD_WOULD_NOT_FIT, "param": None, "code": 503,
                     "reason": "in_prefill", "retryable": True, "prompt_tokens": 700,
                     "prompt_tokens_counted_by": "words", "limit_tokens": 600, "node": "node-a", "rank": "0",
                     "hook": "http://node-a:9200"}
    assert (refusal.status, refusal.headers, refusal.reason, refusal.counted_as) == \
        (503, (("Retry-After", "1"), ("x-should-retry", "true")), "in_prefill", "in_prefill")


def test_an_uncountable_prompt_is_a_permanent_bad_request():
    refusal = uncountable(PromptSize(5000, False, None, countable=False), LIMIT)
    error = refusal.body["error"]
    assert error == {"message": error["message"], "type": GUARD_BAD_REQUEST, "param": "prompt_embeds", "code": 400,
                     "reason": "uncountable", "retryable": False, "prompt_tokens": 5000,
                     "prompt_tokens_counted_by": "embedding_bytes", "limit_tokens": 600}
    assert (refusal.status, refusal.headers, refusal.reason) == (400, (("x-should-retry", "false"),), "bad_request")


def test_without_a_reserve_the_limit_is_the_ranks_own():
    tracker = LimitTracker([parse_url("http://127.0.0.1:1")], stale_s=5)
    assert tracker.why_blind() == "http://127.0.0.1:1/metrics: no answer yet"
    assert tracker.limit() is None
    started = time.monotonic()
    assert tracker.blind_seconds_now(started + 10) >= 10   # the episode still going counts
    tracker.record(tracker.hooks[0], [RankFit("0", "a", 1000, 8 << 30, time.time())], None)
    limit = tracker.limit()
    assert limit is not None and limit.tokens == 1000   # a budget exported, no byte of it reserved


def test_a_guard_that_has_read_no_hook_yet_admits_blind_and_reports_no_fresh_rank():
    metrics = GuardMetrics()
    proxy = GuardProxy(parse_base_url("http://127.0.0.1:1"), LimitTracker([parse_url("http://127.0.0.1:2")],
                                                                          stale_s=5), metrics)
    assert proxy.when_blind == "admit"   # --when-blind's default
    registry = guard_registry(metrics, proxy.tracker, proxy.replicas)
    assert registry.get_sample_value("memtel_guard_fresh_ranks") == 0
    assert registry.get_sample_value("memtel_guard_hooks") == 1
