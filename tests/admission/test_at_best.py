"""The at-best book: only clean readings kept, the highest within the window stands (the clock passed in)."""

from __future__ import annotations

from telemetry.admission.at_best import AtBestBook
from telemetry.admission.readings import RankFit


def fit(at_best: int | None, at: float, tokens: int = 1000, rank: str = "0") -> RankFit:
    return RankFit(rank, "node-a", tokens, 4e9, at, (), at_best)


def test_a_reading_taken_while_a_prefill_was_in_flight_is_not_kept_and_the_highest_clean_one_stands():
    book = AtBestBook(60.0)
    hook = "http://h:9200/metrics"
    book.observe(hook, [fit(5000, 999.0)], 1000.0)
    assert book.best(hook, fit(None, 0), 1000.0) == (5000, 999.0)
    book.started(1010.0)                                     # a prefill of the guard's is in flight from 1010 ...
    book.observe(hook, [fit(3000, 1011.0)], 1010.0)          # ... so this snapshot holds its activations: too low
    book.ended(1020.0)                                       # ... to 1020
    book.observe(hook, [fit(4500, 1020.3)], 1020.0)          # within the clocks' margin of the prefill: not kept
    book.observe(hook, [fit(4000, 1023.0)], 1020.0)          # clean
    assert book.best(hook, fit(None, 0), 1020.0) == (5000, 999.0)   # the highest clean reading of the window
    book.observe(hook, [], 1070.0)                           # the 999 reading is past the 60 s window
    assert book.best(hook, fit(None, 0), 1070.0) == (4000, 1023.0)
    assert book.best(hook, fit(None, 0), 1090.0) is None     # no clean reading within the window: unknown


def test_overlapping_prefills_keep_the_span_open_until_the_last_ends():
    book = AtBestBook(60.0)
    book.started(100.0)
    book.started(101.0)
    book.ended(102.0)
    assert not book.clean(110.0)                              # one is still in flight
    book.ended(120.0)
    assert book.clean(121.0) and not book.clean(120.4)        # the margin after the last end
    book.ended(130.0)                                         # an end without a start changes nothing
    assert book.in_flight == 0 and book.clean(125.0)
