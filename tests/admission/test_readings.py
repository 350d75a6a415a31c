"""A replica's readings: fresh ranks, the limit, the hooks that answer without the forecast, the prompt's own
forecast (the clocks passed in)."""

from __future__ import annotations

from telemetry.admission.readings import NO_GAUGE_HINT, RankFit, Readings
from telemetry.url import parse_url

WALL = 1_000_000.0


def test_the_limit_is_the_smallest_fresh_rank_less_what_is_in_prefill_and_reads_nothing_else():
    readings = Readings([parse_url("http://a:9200"), parse_url("http://b:9200")], stale_s=5)
    a, b = readings.hooks
    readings.record_at(a, [RankFit("0", "n", 5000, 4e9, WALL)], None, [], 10.0, WALL)
    readings.record_at(b, [RankFit("1", "n", 3000, 4e9, WALL)], None, [], 10.0, WALL)
    readings.hold_at(1000, WALL)
    limit = readings.limit_at(11.0, WALL + 1)
    assert limit is not None and (limit.tokens, limit.rank_tokens, limit.fit.rank) == (2000, 3000, "1")
    assert readings.limit_at(16.0, WALL + 1) is None          # the answers are older than stale_s
    assert readings.blind is None                              # limit_at changes nothing: blindness is noted apart
    assert readings.note_blind(True, 16.0) == "blind" and readings.note_blind(True, 17.0) is None
    assert readings.note_blind(False, 20.0) == "sees" and readings.blind_seconds_now(30.0) == 4.0


def test_a_hook_that_answers_without_the_forecast_is_named_with_the_variable_to_set():
    readings = Readings([parse_url("http://a:9200")], stale_s=5)
    hook = readings.hooks[0]
    assert readings.without_gauge() == []                      # no answer yet: unknown, not "without"
    readings.record_at(hook, [], None, [], 10.0, WALL)
    assert readings.without_gauge() == ["http://a:9200/metrics"]
    assert "MEMTEL_FORECAST_TOKENS" in NO_GAUGE_HINT and NO_GAUGE_HINT in readings.why_blind_at(11.0, WALL)
    readings.record_at(hook, [], None, ["rank 0 on node n: memtel_forecast_max_prefill_tokens is nan"], 12.0, WALL)
    assert readings.without_gauge() == []                      # it exports the gauge, with nonsense in it


def test_the_forecast_quoted_is_the_prompts_own_length_drawn_between_the_hooks_lengths():
    fit = RankFit("0", "n", 1000, 4e9, WALL, ((100_000, 1e9), (1_048_576, 9e9)))
    assert fit.forecast_at(100_000) == (1e9, (100_000,))       # a length the hook forecasts: its own figure
    bytes_, lengths = fit.forecast_at(360_000) or (0.0, ())
    assert lengths == (100_000, 1_048_576) and 1e9 < bytes_ < 9e9
    assert round(bytes_) == round(1e9 + 8e9 * 260_000 / 948_576)
    assert fit.forecast_at(50_000) == (0.5e9, (100_000,))      # below the shortest: the line from 0
    assert fit.forecast_at(2_000_000) is None                  # above the longest: no forecast
