"""The report counts hooked calls one way everywhere: the calls inside the requests' windows.

A call log also holds calls made outside any request (a rank's warm-up); the note beside the per-call plots
counted the whole log and said 3,826 where the tables said 3,825 (the demo report on the H200).
"""

from __future__ import annotations

from types import SimpleNamespace

from harness.ab.report.tables import hooked_calls_note


def request(arm, step, calls_per_rank):
    return SimpleNamespace(arm=arm, repeat=0, step=step,
                           hook={rank: SimpleNamespace(calls=n) for rank, n in calls_per_rank.items()})


def test_the_note_counts_the_calls_the_tables_count():
    whole_log = {0: list(range(3826)), 1: list(range(3826))}   # one warm-up call more than the requests made
    run = SimpleNamespace(arms=["stock", "fixed"], hook_calls=lambda arm, repeat: whole_log)
    requests = {(arm, 0, step): request(arm, step, {0: n, 1: n})
                for arm, steps in {"stock": {"a": 765, "b": 765, "c": 2295}, "fixed": {"a": 2205, "b": 2205,
                                                                                     "c": 4410}}.items()
                for step, n in steps.items()}
    note = hooked_calls_note(SimpleNamespace(run=run, requests=requests))
    assert "stock 3,825, fixed 8,820" in note and "3,826" not in note
