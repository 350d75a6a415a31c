"""The queue's order rules, decided on the core's state alone (no event loop, the clock passed in)."""

from __future__ import annotations

from telemetry.admission.core import Prompt
from telemetry.admission.prompt import measure
from telemetry.admission.queue import WaitLine


def _line(*waiters: tuple[int, bool], queue_s: float = 10.0,
          since: float = 0.0) -> tuple[WaitLine[Prompt], list[Prompt]]:
    line = WaitLine(queue_s, 8)
    prompts = [Prompt(measure("/v1/completions", {"prompt": [1]})) for _ in waiters]
    for prompt, (tokens, proven) in zip(prompts, waiters, strict=True):
        line.join(prompt, tokens, proven, since)
    return line, prompts


def test_each_woken_waiter_spends_its_tokens_of_the_room():
    line, prompts = _line((60, True), (60, True), (40, True))
    # 100 tokens of room: the first 60 fit, the second 60 no longer does, the 40 passes it (the head is young).
    assert line.wake([100], 100, None, now=1.0) == [prompts[0], prompts[2]]
    assert line.wake([100], 100, None, now=1.0) == []          # woken ones keep their room while decided again


def test_a_head_that_waited_its_turn_lets_nothing_pass_and_a_newcomer_waits_behind_it():
    line, prompts = _line((150, True), (40, True), queue_s=4.0)  # pass_s 1 s
    assert line.wake([100], 200, None, now=0.5) == [prompts[1]]   # young head: the small one passes
    line, prompts = _line((150, True), (40, True), queue_s=4.0)
    assert line.wake([100], 200, None, now=1.0) == []             # the head waited its turn, fits at rest
    assert line.blocked(200, now=1.0)
    head, _ = _line((150, True), queue_s=4.0)
    assert head.blocked(200, now=1.0) and not head.blocked(100, now=1.0)  # over the rank at rest: blocks nobody
    assert not head.blocked(200, now=0.9)                                 # not yet its turn


def test_only_waiters_whose_count_proves_them_over_the_at_best_limit_are_woken_for_their_400():
    line, prompts = _line((1500, True), (1500, False), (900, True))
    # Proven over 1,200: woken to leave with the 400; a byte bound proves nothing; 900 neither fits nor is over.
    assert line.wake([100], 100, 1200, now=0.0) == [prompts[0]]
    assert prompts[0].waiting is not None and prompts[0].waiting.trying


def test_leaving_takes_a_prompt_out_once_and_says_since_when_it_waited():
    line, prompts = _line((10, True), since=3.0)
    assert line.leave(prompts[0]) == 3.0 and line.leave(prompts[0]) is None and line.waiters == []
