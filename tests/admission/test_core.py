"""The admission core decided directly: no server, no event loop, the clocks passed in (thousands a second)."""

from __future__ import annotations

import base64
import time

import pytest

from telemetry.admission import (
    Admission,
    CountFirst,
    Forward,
    Hold,
    Now,
    Prompt,
    RankFit,
    Readings,
    ReadModels,
    Refusal,
    RefusePermanent,
    RefuseTransient,
    Replica,
    Settings,
    measure,
)
from telemetry.admission.prompt import SPECIAL_TOKENS_PER_PROMPT
from telemetry.url import parse_url

WALL = 1_000_000.0
T0 = Now(100.0, WALL)


def at(seconds: float) -> Now:
    return Now(T0.monotonic + seconds, T0.wall + seconds)


def replica(name: str = "http://e:8000", tokens: int = 1000, *, at_best: int | None = None) -> Replica:
    readings = Readings([parse_url(name.replace("8000", "9200"))], stale_s=30)
    readings.record_at(readings.hooks[0], [RankFit("0", "node", tokens, 4e9, WALL, (), at_best)], None, [],
                       T0.monotonic, T0.wall)
    return Replica(name, readings)


def words(n: int) -> Prompt:
    return Prompt(measure("/v1/completions", {"model": "m", "prompt": "w " * n}))


def ids(n: int) -> Prompt:
    return Prompt(measure("/v1/completions", {"model": "m", "prompt": [1] * n}))


def settle(core: Admission, prompt: Prompt, now: Now, *, count: int | None = None,
           models: dict[str, int] | None = None):
    """Decide, performing CountFirst (with `count`) and ReadModels (with `models`) as a front door would."""
    for _ in range(6):
        decision = core.decide(prompt, now)
        if isinstance(decision, CountFirst):
            assert count is not None, "asked to count"
            prompt.counted(count)
        elif isinstance(decision, ReadModels):
            core.models_read(decision.replica, models, now)
        else:
            return decision
    raise AssertionError("no decision after six steps")


def test_a_prompt_that_fits_by_its_bytes_is_forwarded_holding_them_until_released():
    core = Admission([replica(tokens=10_000)])   # its bytes a small share of the rank: held, not counted
    decision = core.decide(words(100), T0)
    assert isinstance(decision, Forward) and decision.counted_by == "byte_bound" and decision.tokens >= 100
    assert core.replicas[0].readings.in_prefill_tokens == decision.tokens
    core.release(decision, at(1))
    assert core.replicas[0].readings.in_prefill_tokens == 0


def test_a_prompt_over_the_limit_by_its_words_reads_max_model_len_then_is_refused_for_now():
    core = Admission([replica()])
    prompt = words(1500)
    first = core.decide(prompt, T0)
    assert isinstance(first, ReadModels)                       # max-model-len is read only when a prompt is over
    core.models_read(first.replica, None, T0)                  # the read failed: unknown
    decision = core.decide(prompt, T0)
    assert isinstance(decision, RefuseTransient) and decision.status == 503 and decision.retry_after == 10
    assert (decision.reason, decision.counted_as, decision.body["error"]["prompt_tokens"]) == \
        ("would_not_fit", "would_not_fit", 1500)


def test_ids_over_max_model_len_are_a_permanent_400_without_a_count():
    core = Admission([replica()])
    decision = settle(core, ids(3000), T0, models={"m": 2000})
    assert isinstance(decision, RefusePermanent) and decision.status == 400
    assert decision.headers == (("x-should-retry", "false"),) and decision.counted_as == "context_length_exceeded"


def test_words_that_may_or_may_not_reach_max_model_len_are_counted_to_say_which():
    core = Admission([replica(tokens=1000)])
    prompt = Prompt(measure("/v1/completions", {"model": "m", "prompt": "wordy " * 1500}))  # bytes 9,000: undecided
    assert isinstance(core.decide(prompt, T0), ReadModels)
    core.models_read(core.replicas[0], {"m": 4000}, T0)
    asked = core.decide(prompt, T0)
    assert isinstance(asked, CountFirst) and asked.body["prompt"] == "wordy " * 1500
    prompt.counted(4500)
    decision = core.decide(prompt, T0)
    assert isinstance(decision, RefusePermanent) and decision.body["error"]["prompt_tokens_counted_by"] == "tokenize"
    failed = Prompt(prompt.size)                              # the same prompt, the count failing: its words stand
    assert isinstance(core.decide(failed, T0), CountFirst)
    failed.not_counted(Refusal(502, {"error": {"message": "down"}}))
    assert isinstance(core.decide(failed, T0), RefuseTransient)


def test_a_count_is_decided_on_the_limit_when_it_arrives_not_the_one_before_it():
    core = Admission([replica(tokens=10_000)])
    # Text without spaces: its bytes bound far above its words and would hold a large share: counted to hold.
    prompt = Prompt(measure("/v1/completions", {"model": "m", "prompt": "x" * 4000}))
    assert isinstance(core.decide(prompt, T0), CountFirst)
    other = core.decide(ids(9000), T0)                        # meanwhile another prefill is admitted: 1,000 left
    assert isinstance(other, Forward)
    prompt.counted(2000)
    decision = settle(core, prompt, T0)
    assert isinstance(decision, RefuseTransient) and decision.reason == "in_prefill"
    core.release(other, T0)
    assert isinstance(core.decide(prompt, T0), Forward)       # the same count, the limit risen: forwarded


def test_a_failed_count_forwards_by_the_bytes_where_they_fit_else_relays_the_upstreams_answer():
    core = Admission([replica(tokens=10_000)])
    prompt = Prompt(measure("/v1/completions", {"model": "m", "prompt": "x" * 4000}))
    assert isinstance(core.decide(prompt, T0), CountFirst)
    prompt.not_counted(Refusal(404, {"error": {"message": "no such model"}}))
    decision = core.decide(prompt, T0)
    assert isinstance(decision, Forward) and decision.counted_by == "byte_bound"
    tight = Admission([replica(tokens=2000)])
    prompt = Prompt(measure("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"},
                                                                                {"role": "user", "content": "y"}]}))
    assert isinstance(tight.decide(prompt, T0), CountFirst)   # the template's allowance is over 2,000
    prompt.not_counted(Refusal(404, {"error": {"message": "no such model"}}))
    relayed = tight.decide(prompt, T0)
    assert isinstance(relayed, RefusePermanent) and relayed.status == 404 and relayed.counted_as is None


def test_no_fresh_limit_is_decided_by_when_blind():
    blind = Replica("http://e:8000", Readings([parse_url("http://e:9200")], stale_s=30))
    admitted = Admission([blind]).decide(words(10**6), T0)
    assert isinstance(admitted, Forward) and (admitted.tokens, admitted.counted_by) == (0, "blind")
    refused = Admission([blind], Settings(when_blind="reject")).decide(words(10), T0)
    assert isinstance(refused, RefuseTransient) and refused.counted_as == "blind" and refused.status == 503
    assert "no answer yet" in refused.body["error"]["message"]
    with pytest.raises(ValueError, match="when_blind"):
        Settings(when_blind="maybe")


def test_a_prompt_that_does_not_fit_now_is_held_woken_when_room_frees_and_forwarded():
    core = Admission([replica(tokens=1000)], Settings(queue_s=10.0))
    first = core.decide(ids(800), T0)
    assert isinstance(first, Forward)
    waiting = ids(500)
    held = settle(core, waiting, T0)
    assert isinstance(held, Hold) and held.deadline == T0.monotonic + 10.0 and held.reason == "in_prefill"
    assert core.queued == 1 and core.wake(at(1)) == []         # no room yet
    core.release(first, at(2))
    assert core.wake(at(2)) == [waiting]
    decision = core.decide(waiting, at(2))
    assert isinstance(decision, Forward) and decision.queue_outcome == "admitted" and decision.waited_s == 2.0
    assert core.queued == 0


def test_a_held_prompt_gets_its_last_refusal_at_the_deadline_saying_how_long_it_waited():
    core = Admission([replica(tokens=1000)], Settings(queue_s=3.0))
    prompt = ids(1500)
    assert isinstance(settle(core, prompt, T0), Hold)
    decision = core.decide(prompt, at(3))
    assert isinstance(decision, RefuseTransient) and decision.queue_outcome == "timed_out"
    assert decision.body["error"]["queued_s"] == 3.0 and "after waiting 3.0 s in the queue" in decision.body["error"][
        "message"]
    assert core.queued == 0


def test_a_full_queue_refuses_at_once_and_a_client_that_leaves_leaves_the_queue():
    core = Admission([replica(tokens=1000)], Settings(queue_s=10.0, max_queued=1))
    first = ids(1500)
    assert isinstance(settle(core, first, T0), Hold)
    decision = settle(core, ids(1500), T0)
    assert isinstance(decision, RefuseTransient) and decision.queue_outcome == "queue_full"
    assert "--max-queued" in decision.body["error"]["queue"]
    assert core.leave(first, at(4)) == 4.0 and core.queued == 0


def test_the_queue_off_refuses_what_does_not_fit_now_at_once():
    core = Admission([replica(tokens=1000)], Settings(queue_s=0.0))
    assert isinstance(settle(core, ids(1500), T0), RefuseTransient) and core.queued == 0


def test_the_prompt_goes_to_the_replica_with_the_most_room_and_an_unreachable_one_leaves_the_pool():
    small, large = replica("http://a:8000", 1000), replica("http://b:8000", 5000)
    core = Admission([small, large])
    decision = core.decide(ids(100), T0)
    assert isinstance(decision, Forward) and decision.replica is large
    assert core.unreachable(decision, "cannot connect: Connection refused", T0)
    assert large.readings.in_prefill_tokens == 0 and not large.healthy
    again = core.decide(ids(100), T0)
    assert isinstance(again, Forward) and again.replica is small
    core.unreachable(again, "cannot connect", T0)
    none = core.decide(ids(100), T0)
    assert isinstance(none, RefuseTransient) and none.reason == "no_replica" and "http://a:8000" in \
        none.body["error"]["message"]
    core.pool.back(small)
    assert isinstance(core.decide(ids(100), T0), Forward)


def test_a_newcomer_that_fits_waits_behind_a_head_that_waited_its_turn():
    core = Admission([replica(tokens=1000)], Settings(queue_s=4.0))
    running = core.decide(ids(600), T0)
    assert isinstance(running, Forward)
    head = ids(900)
    assert isinstance(settle(core, head, T0), Hold)
    assert isinstance(core.decide(ids(100), at(0.5)), Forward)   # the head is young: a small one passes
    behind = core.decide(ids(100), at(1.0))                      # the head waited pass_s: the newcomer queues
    assert isinstance(behind, Hold) and "waits behind an earlier request" in behind.refusal.body["error"]["message"]


def test_a_held_prompt_proven_over_the_at_best_limit_leaves_with_the_permanent_400():
    core = Admission([replica(tokens=1000, at_best=1200)], Settings(queue_s=10.0))
    prompt = ids(1100)
    assert isinstance(settle(core, prompt, T0, models=None), Hold)   # 1,100 may fit at best: it waits
    over = ids(1500)
    decision = settle(core, over, T0)
    assert isinstance(decision, RefusePermanent) and decision.reason == "exceeds_memory_at_best"


def test_thousands_of_decisions_a_second():
    core = Admission([replica("http://a:8000", 10**6), replica("http://b:8000", 10**6)], Settings(queue_s=10.0))
    prompt_size = measure("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi " * 50}]})
    started = time.perf_counter()
    for n in range(2000):
        decision = core.decide(Prompt(prompt_size), at(n / 1000))
        assert isinstance(decision, Forward)
        core.release(decision, at(n / 1000))
    assert time.perf_counter() - started < 2.0   # at least 1,000 a second on a loaded 2-core machine


def test_the_blind_refusal_says_why_names_the_hooks_and_is_never_held():
    blind = Replica("http://e:8000", Readings([parse_url("http://127.0.0.1:20")], stale_s=30))
    core = Admission([blind], Settings(when_blind="reject", queue_s=10.0))
    decision = core.decide(words(10), T0)
    assert isinstance(decision, RefuseTransient) and core.queued == 0   # waiting cannot cure blindness
    error = decision.body["error"]
    assert (decision.status, error["type"], error["hooks"]) == (503, "memtel_guard_blind", ["http://127.0.0.1:20/metrics"])
    assert error["message"] == ("the memtel guard is blind (no fresh forecast from any hook) and refuses requests "
                                "until it sees again (--when-blind reject): http://127.0.0.1:20/metrics: no answer yet")


def test_no_replica_healthy_names_each_replicas_error_and_waits_for_one_to_come_back():
    a, b = replica("http://a:8000"), Replica("http://b:8000", Readings([parse_url("http://b:9200")], stale_s=30))
    core = Admission([a, b], Settings(queue_s=5.0))
    core.pool.leave(a, "/health: 503")
    core.pool.leave(b, "cannot connect: Connection refused")
    prompt = words(3)
    held = core.decide(prompt, T0)
    assert isinstance(held, Hold) and held.reason == "no_replica"
    assert str(held.refusal) == ("memtel guard: no replica is healthy now (http://a:8000: /health: 503; "
                                 "http://b:8000: cannot connect: Connection refused)")
    assert core.wake(at(1)) == []
    core.pool.back(b)                                            # its /health answers again
    assert core.wake(at(1)) == [prompt]                          # blind and admitting: decided again
    decision = core.decide(prompt, at(1))
    assert isinstance(decision, Forward) and (decision.replica, decision.counted_by) == (b, "blind")


@pytest.mark.parametrize("status, reason, held", [
    (503, "would_not_fit", True), (503, "in_prefill", True), (503, "no_replica", True), (503, "blind", False),
    (400, "would_not_fit", False), (502, None, False)])
def test_only_a_refusal_for_room_is_cured_by_waiting(status, reason, held):
    core = Admission([replica()], Settings(queue_s=5.0))
    refusal = Refusal(status, {"error": {"message": "m"}}, 5 if status == 503 else None, reason=reason)
    decision = core._refused(ids(1), refusal, reason, None, T0)
    assert isinstance(decision, Hold) is held and core.queued == (1 if held else 0)


class _Upstream:
    """The upstream's count (the prompt's whole count) and its model cards, as a front door reads them, recorded."""

    def __init__(self, count=None, max_model_len=None):
        self.count, self.max_model_len, self.calls = count, max_model_len, []


def _admit(body, upstream, rank_tokens=1000, path="/v1/completions"):
    """One prompt decided to its end, CountFirst and ReadModels performed against `upstream`: (the answer: (tokens
    held, counted by) or the refusal decision, the tokens in prefill after it, the reasons counted)."""
    core = Admission([replica(tokens=rank_tokens)])
    prompt, rejected = Prompt(measure(path, body)), []
    for _ in range(6):
        decision = core.decide(prompt, T0)
        if isinstance(decision, CountFirst):
            upstream.calls.append("/tokenize")
            if upstream.count is None:
                prompt.not_counted(Refusal(502, {"error": {"message": "the upstream could not count"}}))
            else:
                prompt.counted(upstream.count - prompt.size.counted_tokens)
        elif isinstance(decision, ReadModels):
            upstream.calls.append("/v1/models")
            core.models_read(decision.replica, {"m": upstream.max_model_len} if upstream.max_model_len else {}, T0)
        elif isinstance(decision, Forward):
            return (decision.tokens, decision.counted_by), core.replicas[0].readings.in_prefill_tokens, rejected
        else:
            if decision.counted_as is not None:
                rejected.append(decision.counted_as)
            return decision, core.replicas[0].readings.in_prefill_tokens, rejected
    raise AssertionError("no decision after six steps")


def test_one_word_and_many_spaces_holds_its_count_not_its_bytes():
    upstream = _Upstream(count=1)
    answer, held, _ = _admit({"prompt": "word" + " " * 399_999}, upstream, rank_tokens=401_244)
    assert answer == (1, "tokenize") and held == 1 and upstream.calls == ["/tokenize"]


def test_a_failed_count_for_the_hold_admits_by_the_byte_bound():
    answer, held, _ = _admit({"prompt": "word" + " " * 399_999}, _Upstream(count=None), rank_tokens=401_244)
    assert answer == (400_003 + SPECIAL_TOKENS_PER_PROMPT, "byte_bound") and held == answer[0]


def test_words_over_max_model_len_are_refused_permanently_without_tokenize():
    upstream = _Upstream(count=10**9, max_model_len=2000)
    refusal, held, rejected = _admit({"prompt": "w " * 3000}, upstream)
    assert isinstance(refusal, RefusePermanent) and refusal.status == 400 and held == 0
    assert upstream.calls == ["/v1/models"] and rejected == ["context_length_exceeded"]


def test_words_below_max_model_len_with_more_bytes_are_counted_to_tell_permanent_from_transient():
    upstream = _Upstream(count=2500, max_model_len=2000)
    refusal, _, _ = _admit({"prompt": "w " * 1500}, upstream)  # 1,500 words, 3,002 bytes: maybe over 2,000
    assert refusal.status == 400 and refusal.body["error"]["prompt_tokens_counted_by"] == "tokenize"
    assert upstream.calls == ["/v1/models", "/tokenize"]
    upstream = _Upstream(count=1600, max_model_len=2000)
    refusal, _, rejected = _admit({"prompt": "w " * 1500}, upstream)
    assert refusal.status == 503 and rejected == ["would_not_fit"]


def test_a_field_only_the_engine_can_count_is_counted_even_when_the_bytes_fit():
    upstream = _Upstream(count=7)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    answer, held, _ = _admit(body, upstream, rank_tokens=100_000, path="/v1/chat/completions")
    assert answer == (7, "tokenize") and held == 7 and upstream.calls == ["/tokenize"]


def test_prompt_embeds_are_admitted_by_their_byte_bound_or_refused_never_guessed():
    small = base64.b64encode(b"\0" * 500).decode()
    answer, _, _ = _admit({"prompt_embeds": small}, _Upstream())
    assert answer == (500, "byte_bound")
    big = base64.b64encode(b"\0" * 5000).decode()
    refusal, held, rejected = _admit({"prompt_embeds": big}, _Upstream())
    assert refusal.status == 400 and refusal.body["error"]["param"] == "prompt_embeds" and held == 0
    assert "cannot be counted" in refusal.body["error"]["message"] and rejected == ["bad_request"]


def test_a_prompt_over_a_mebibyte_is_answered_by_its_words_without_a_slow_count():
    upstream = _Upstream(count=250_000, max_model_len=200_000)
    refusal, _, _ = _admit({"prompt": "wwwwwwww " * 150_000}, upstream)  # 1.35 MB, 150,000 words
    assert refusal.status == 503 and refusal.body["error"]["prompt_tokens_counted_by"] == "words"
    assert upstream.calls == ["/v1/models"]


def test_max_model_len_is_read_once_a_minute_and_a_failed_read_keeps_what_was_known():
    core = Admission([replica()])
    assert isinstance(core.decide(ids(1500), T0), ReadModels)
    core.models_read(core.replicas[0], {"m": 2000, "other": 1000}, T0)
    assert isinstance(settle(core, ids(2500), at(29)), RefusePermanent)   # known: no second read within the minute
    assert core.replicas[0].models.get("m") == 2000 and core.replicas[0].models.get(None) == 1000  # none: the least
    readings = core.replicas[0].readings
    readings.record_at(readings.hooks[0], [RankFit("0", "node", 1000, 4e9, WALL + 61)], None, [], *at(61))
    prompt = ids(2500)
    assert isinstance(core.decide(prompt, at(61)), ReadModels)              # a minute on: read again
    core.models_read(core.replicas[0], None, at(61))                        # the read failed
    assert isinstance(core.decide(prompt, at(61)), RefusePermanent)         # what was known stands


def test_a_held_prompt_refused_blind_leaves_the_queue_counted_refused_with_each_ranks_reason():
    core = Admission([replica(tokens=1000)], Settings(when_blind="reject", queue_s=60.0))
    prompt = ids(1500)
    assert isinstance(settle(core, prompt, T0), Hold)
    readings = core.replicas[0].readings   # the hook answers on, but its forecast stopped: stale by its own time
    readings.record_at(readings.hooks[0], [RankFit("0", "node", 1000, 4e9, WALL)], None, [], *at(40))
    decision = core.decide(prompt, at(40))
    assert isinstance(decision, RefuseTransient) and decision.queue_outcome == "refused" and core.queued == 0
    assert (decision.status, decision.body["error"]["code"], decision.counted_as) == (503, 503, "blind")
    assert decision.body["error"]["message"].endswith("http://e:9200/metrics: forecast older than 30 s")


def test_every_replica_down_is_a_503_of_the_upstream_unavailable_type_counted_no_replica():
    a, b = replica("http://a:8000"), replica("http://b:8000")
    core = Admission([a, b])
    core.pool.leave(a, "/health: 503")
    core.pool.leave(b, "/health: 503")
    decision = core.decide(ids(10), T0)
    assert isinstance(decision, RefuseTransient) and decision.counted_as == "no_replica"
    error = decision.body["error"]
    assert (decision.status, error["type"], error["code"], error["retryable"]) == (503, "memtel_upstream_unavailable",
                                                                                   503, True)
    assert core.no_replica().counted_as == "no_replica"
    assert "blind" not in core.pool.why_blind(*at(0))   # (fresh readings: each replica says so)


def test_the_why_blind_of_several_replicas_names_each_and_reads_the_forecasts_time():
    a, b = replica("http://a:8000"), replica("http://b:8000")
    core = Admission([a, b])
    assert core.pool.why_blind(*at(0)) == ("http://a:8000: http://a:9200/metrics: fresh; "
                                           "http://b:8000: http://b:9200/metrics: fresh")
    assert "forecast older than 30 s" in core.pool.why_blind(T0.monotonic + 1, WALL + 40)


def test_over_one_replicas_max_model_len_is_no_permanent_400_while_another_replica_takes_it():
    # Issue 41: replicas that differ in max-model-len gave the permanent 400 of the one with the most room.
    short, long_ = replica("http://a:8000", tokens=1000), replica("http://b:8000", tokens=500)
    core = Admission([short, long_])
    read = []
    prompt = ids(3000)
    for _ in range(6):
        decision = core.decide(prompt, T0)
        if not isinstance(decision, ReadModels):
            break
        read.append(decision.replica.name)
        core.models_read(decision.replica, {"m": 2000 if decision.replica is short else 8000}, T0)
    assert read == ["http://a:8000", "http://b:8000"]   # the chosen replica's first, then the other's
    assert isinstance(decision, RefuseTransient) and decision.status == 503   # b takes 3,000 once it has room
    assert isinstance(settle(core, ids(9000), T0), RefusePermanent)           # over every replica's: permanent


def test_a_replica_whose_max_model_len_is_unknown_makes_the_refusal_transient():
    short, unknown = replica("http://a:8000", tokens=1000), replica("http://b:8000", tokens=500)
    core = Admission([short, unknown])
    prompt = ids(3000)
    for _ in range(6):
        decision = core.decide(prompt, T0)
        if not isinstance(decision, ReadModels):
            break
        core.models_read(decision.replica, {"m": 2000} if decision.replica is short else None, T0)
    assert isinstance(decision, RefuseTransient)


def test_prompt_embeds_that_fit_the_rank_alone_wait_for_the_prefills_beside_them_not_a_permanent_400():
    # Issue 41: prompt_embeds that get a 200 alone were refused 400 while another prefill ran.
    core = Admission([replica(tokens=1000)], Settings(queue_s=30))
    first = core.decide(ids(600), T0)
    assert isinstance(first, Forward)
    embeds = Prompt(measure("/v1/completions", {"prompt_embeds": base64.b64encode(b"\0" * 800).decode()}))
    held = core.decide(embeds, T0)
    assert isinstance(held, Hold) and held.refusal.status == 503 and held.refusal.reason == "in_prefill"
    core.release(first, at(1))
    assert core.wake(at(1)) == [embeds]
    assert isinstance(core.decide(embeds, at(1)), Forward)
    alone = Admission([replica(tokens=1000)])   # without the queue: a transient 503, never a 400
    alone.decide(ids(600), T0)
    refusal = alone.decide(Prompt(measure("/v1/completions",
                                          {"prompt_embeds": base64.b64encode(b"\0" * 800).decode()})), T0)
    assert isinstance(refusal, RefuseTransient) and refusal.status == 503


def test_a_prompt_that_fits_now_is_never_refused_queue_full_behind_prompts_that_fit_only_at_rest():
    # Issue 41: with --queue-s, a prompt that fit now got 503 "queue full" behind prompts that fit only at rest.
    core = Admission([replica(tokens=1000)], Settings(queue_s=30, max_queued=1))
    first = core.decide(ids(600), T0)
    assert isinstance(first, Forward)
    assert isinstance(settle(core, ids(900), T0), Hold)       # fits at rest, not beside the 600: waits (full now)
    later = at(core.line.pass_s + 1)                           # the head has waited its turn
    assert isinstance(core.decide(ids(100), later), Forward)   # fits now: on, not 503 "queue full"
