"""`memtel top` shows a stalled engine (issue 29): MemtelEngineStalled's definition (telemetry/ledger/stall.py),
checked against the shipped rule, decided over frames, and shown in top's frame from real expositions (the engine's
read with prometheus_client's parser, written by prometheus_client from the catalogue's vLLM entries)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from telemetry.catalogue.metrics import HOOK_CALLS
from telemetry.catalogue.vllm import GENERATION_TOKENS, ITERATION_TOKENS, NUM_REQUESTS_RUNNING, PROMPT_TOKENS
from telemetry.ledger.scrape import HookView, LedgerReport, NodeView, Scrape
from telemetry.ledger.stall import FOR_S, PROGRESS_SERIES, RUNNING, WINDOW_S, StallWatch, duration
from telemetry.ledger.top_cli import History, frame
from telemetry.scrape import parse_body, series_name

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "telemetry" / "alerts" / "rules" / "memtel-alerts.yml"
UNITS = {"s": 1, "m": 60, "h": 3600}
ENGINE_URL = "http://127.0.0.1:8000/metrics"
HOOK_URL = "http://127.0.0.1:9200/metrics"


def seconds(text: str) -> float:
    return float(text[:-1]) * UNITS[text[-1]]


def stalled_rule() -> dict:
    groups = yaml.load(RULES.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))["groups"]
    (rule,) = [r for g in groups for r in g["rules"] if r.get("alert") == "MemtelEngineStalled"]
    return rule


def test_top_and_the_rule_share_one_definition():
    """The rule's window, `for`, running series and progress series are stall.py's: change one, this fails."""
    rule = stalled_rule()
    expr = rule["expr"]
    assert seconds(rule["for"]) == FOR_S
    windows = re.findall(r"\[(\d+[smh])\]", expr) + re.findall(r"offset (\d+[smh])", expr)
    assert windows and {seconds(w) for w in windows} == {WINDOW_S}, windows
    assert set(re.findall(r"increase\(([A-Za-z_:][\w:]*)\[", expr)) == set(PROGRESS_SERIES)
    assert set(re.findall(r"(?:min_over_time\(|max by \(node\) \()([A-Za-z_:][\w:]*)", expr)) == {RUNNING.series}


def watch_frames(minutes: float, running: float, moving: set[str], step_s: float = 5.0) -> list[str]:
    """A node watched every `step_s` for `minutes`, `running` requests, the counters in `moving` growing: the
    text of each frame's state."""
    watch = StallWatch()
    texts = []
    for n in range(int(minutes * 60 / step_s) + 1):
        counters = {name: float(n if name in moving else 7) for name in PROGRESS_SERIES}
        texts.append(watch.observe("spark", 1000.0 + n * step_s, running, counters).text())
    return texts


@pytest.mark.parametrize("moving", [{series_name(HOOK_CALLS)}, {series_name(ITERATION_TOKENS, "_count")},
                                    {series_name(PROMPT_TOKENS)}, {series_name(GENERATION_TOKENS)}],
                         ids=["hooked-calls", "steps", "prompt-tokens", "generated-tokens"])
def test_a_slow_prefill_moving_one_counter_is_never_stalled(moving):
    assert not any("STALLED" in t for t in watch_frames(10, 1, moving))


def test_requests_running_and_nothing_moving_is_stalled_once_the_rules_window_has_passed():
    texts = watch_frames(4, 2, set())
    assert texts[0] == "2 requests running, progressing"
    assert texts[9] == "2 requests running, no progress for 45s (stalled at 3m00s)"
    assert "STALLED" not in texts[35] and texts[36] == "STALLED for 3m00s (2 requests running, no progress)"
    assert texts[-1] == "STALLED for 4m00s (2 requests running, no progress)"


def test_an_unreadable_counter_is_not_progress_and_progress_or_idle_ends_the_stall():
    watch = StallWatch(window_s=10)
    hook = HOOK_CALLS.series
    assert not watch.observe("n", 0, 1, {hook: 5}).stalled
    assert watch.observe("n", 12, 1, {hook: None}).text() == "STALLED for 12s (1 request running, no progress)"
    assert not watch.observe("n", 13, 1, {hook: 9}).stalled      # the rank resumed: its calls moved
    assert watch.observe("n", 30, 1, {hook: 9}).stalled
    assert watch.observe("n", 31, 0, {hook: 9}).text() == "0 requests running"   # the request ended
    assert not watch.observe("n", 32, 1, {hook: 9}).stalled      # a new request: counted from here
    assert watch.observe("n", 40, None, {hook: 9}).text() == "requests running unknown"


@pytest.mark.parametrize(("value", "text"), [(0, "0s"), (59.9, "59s"), (192, "3m12s"), (7260, "2h01m")])
def test_duration(value, text):
    assert duration(value) == text


class _Engine:
    """An engine's /metrics as vLLM names it, from the catalogue's entries."""

    def __init__(self, running: float, prompt: float, generated: float, steps: float) -> None:
        self.values = running, prompt, generated, steps

    def collect(self) -> list[Metric]:
        running, prompt, generated, steps = self.values
        labels = ["lab", "0"]
        families = [NUM_REQUESTS_RUNNING.new(), PROMPT_TOKENS.new(), GENERATION_TOKENS.new()]
        for family, value in zip(families, (running, prompt, generated), strict=True):
            family.add_metric(labels, value)
        histogram = ITERATION_TOKENS.new()
        histogram.add_metric(labels, buckets=[("1", steps), ("+Inf", steps)], sum_value=steps)
        return [*families, histogram]


def engine_scrape(running: float, prompt: float = 0, generated: float = 0, steps: float = 0) -> Scrape:
    registry = CollectorRegistry()
    registry.register(_Engine(running, prompt, generated, steps))
    return Scrape(ENGINE_URL, parse_body(generate_latest(registry)))


def report(at: float, calls: int | None) -> LedgerReport:
    hook = HookView(HOOK_URL, "spark", None, calls, 0, None, error=None if calls is not None else "timed out")
    node = NodeView("spark", "http://127.0.0.1:9101/metrics", headroom=10 << 30, hooks=[hook])
    return LedgerReport(at, [node])


def frames(calls: list[int | None], engine: list[Scrape], step_s: float = 16.0) -> list[list[str]]:
    history = History()
    shown = []
    for n, (count, scrape_) in enumerate(zip(calls, engine, strict=True)):
        rep = report(1000.0 + n * step_s, count)
        deltas = history.update(rep, [scrape_])
        shown.append(frame(rep, history, deltas, sort="rank", paused=False, width=120, height=200, interval=1))
    return shown


def test_top_shows_a_stalled_engine_in_its_nodes_block_and_as_an_event():
    # 1 request running; the rank answers twice, then its exporter stops answering (SIGSTOP); no counter moves.
    shown = frames([100, 150, *[None] * 12], [engine_scrape(1)] * 14)
    last = shown[-1]
    assert "  engine: STALLED for 3m12s (1 request running, no progress)" in last, "\n".join(last)
    assert last.index("  engine: STALLED for 3m12s (1 request running, no progress)") < last.index(
        next(line for line in last if line.startswith("  hook ")))  # in the node's block, above its ranks
    assert any(line.endswith("spark: engine STALLED for 3m12s (1 request running, no progress)") for line in last)
    assert not any("STALLED" in line for line in shown[-2])  # 2m56s: not yet the rule's window


def test_top_does_not_show_a_slow_prefill_as_stalled():
    # 4 minutes of one prefill: no token and no step counted (the lab counts the step when the prefill ends),
    # only the hook's calls moving.
    shown = frames([100 + 40 * n for n in range(16)], [engine_scrape(1)] * 16)
    assert "  engine: 1 request running, progressing" in shown[-1]
    assert not any("STALLED" in line or "no progress" in line for f in shown for line in f)
    # Same 4 minutes with the hook gone: only the engine's steps move.
    shown = frames([None] * 16, [engine_scrape(1, steps=n) for n in range(16)])
    assert not any("STALLED" in line for f in shown for line in f)
