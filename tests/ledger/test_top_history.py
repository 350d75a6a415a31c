"""What `memtel top` carries from one frame to the next (issue 30, item 4: with it removed, the ledger's tests
passed): the headroom's trend, hooked calls and growth events since the last frame, kernel-log errors as events,
and nothing made up on the first frame or from a frame whose endpoint did not answer."""

from __future__ import annotations

from telemetry.ledger.scrape import HookView, LedgerReport, NodeView
from telemetry.ledger.top_cli import TREND_WINDOW_S, History, frame

GiB = 1 << 30
HOOK = "http://127.0.0.2:9200/metrics"


def report(at: float, headroom: int, calls: int | None, growth: int, xid: int, *, daemon_error: str | None = None,
           hook_error: str | None = None) -> LedgerReport:
    hook = HookView(HOOK, "spark-a", None, calls, growth, None, error=hook_error)
    node = NodeView("spark-a", "http://127.0.0.2:9101/metrics", error=daemon_error,
                    headroom=None if daemon_error else headroom, kernel_errors={} if daemon_error else {"xid": xid},
                    hooks=[hook])
    return LedgerReport(at, [node])


def shown(history: History, rep: LedgerReport) -> list[str]:
    deltas = history.update(rep)
    return frame(rep, history, deltas, sort="rank", paused=False, width=200, height=200, interval=1)


def test_the_second_frame_shows_what_changed_since_the_first():
    history = History()
    first = shown(history, report(1000.0, 10 * GiB, 100, 2, 0))
    assert "headroom -" not in first[1] and "headroom +" not in first[1]   # one point: no trend
    assert any(line.strip() == "calls 100  growth events 2" for line in first)   # no (+N) on a first frame
    assert "events:" not in first
    second = shown(history, report(1002.0, 9 * GiB, 150, 5, 1))
    assert second[1].endswith("  headroom -512M/s"), second[1]   # 1 GiB less in 2 s
    assert any(line.strip() == "calls 150 (+50)  growth events 5 (+3)" for line in second), second
    events = second[second.index("events:") + 1:]
    assert [e.split(" ", 1)[1] for e in events] == ["spark-a: kernel log xid +1", "spark-a: rank ? +3 growth events"]


def test_the_trend_spans_the_window_and_a_silent_endpoint_is_not_a_change():
    history = History()
    shown(history, report(1000.0, 10 * GiB, 100, 2, 0))
    shown(history, report(1001.0, 10 * GiB, None, 2, 0, hook_error="timed out", daemon_error="refused"))
    third = shown(history, report(1002.0, 10 * GiB, 130, 2, 0))
    assert any(line.strip() == "calls 130 (+30)  growth events 2" for line in third)  # against the last answer
    assert "events:" not in third   # the daemon's silent frame made no kernel-log event
    shown(history, report(1008.0, 9 * GiB, 130, 2, 0))
    later = shown(history, report(1014.0, 8 * GiB, 130, 2, 0))
    # Points older than TREND_WINDOW_S (10 s) are gone: the trend is from 1008 s (9 GiB) to 1014 s (8 GiB).
    assert TREND_WINDOW_S == 10 and later[1].endswith(f"  headroom -{1024 / 6:.0f}M/s"), later[1]
