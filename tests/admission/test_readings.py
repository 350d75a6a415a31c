"""A replica's readings: fresh ranks, the limit, the hooks that answer without the forecast, the prompt's own
forecast (the clocks passed in)."""

from __future__ import annotations

from telemetry.admission.readings import NO_GAUGE_HINT, RankFit, Readings, parse_hook
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


def test_a_gauge_past_what_a_node_can_have_is_left_out_and_never_reaches_the_limits_arithmetic():
    labels = 'rank="0",node="n"'
    text = (f"memtel_forecast_max_prefill_tokens{{{labels}}} 1e308\nmemtel_forecast_fit_budget_bytes{{{labels}}} "
            f"1e308\nmemtel_forecast_last_success_timestamp_seconds{{{labels}}} {WALL}\n"
            f'memtel_forecast_max_prefill_tokens{{rank="1",node="n"}} 4096\n'
            f'memtel_forecast_fit_budget_bytes{{rank="1",node="n"}} 4e9\n'
            f'memtel_forecast_reserved_growth_bytes{{tokens="100",rank="1",node="n"}} 1e300\n'
            f'memtel_forecast_max_prefill_tokens_at_best{{rank="1",node="n"}} 3e9\n'
            f'memtel_forecast_last_success_timestamp_seconds{{rank="1",node="n"}} {WALL}\n')
    fits, rejected = parse_hook(text)
    assert fits == [] and len(rejected) == 2
    assert rejected[0] == ("rank 0 on node n: memtel_forecast_max_prefill_tokens is 1e+308, "
                           "memtel_forecast_fit_budget_bytes is 1e+308")
    assert rejected[1] == "rank 1 on node n: memtel_forecast_max_prefill_tokens_at_best is 3e+09"   # over 2^31
    fits, _ = parse_hook(text.replace("3e9", "3000"))
    assert [f.rank for f in fits] == ["1"] and fits[0].growth_bytes == ()   # 1e300 bytes forecast: dropped
    assert fits[0].tokens(1 << 30) == 2996   # with a reserve: 4096 * (4e9 - 2^30) / 4e9, finite


def test_a_hooks_labels_are_escaped_before_any_message_quotes_them():
    text = ('memtel_forecast_max_prefill_tokens{rank="0\\n\\u001b[31m",node="n\\u202e"} nan\n'
            'memtel_forecast_max_prefill_tokens{rank="1",node="' + "x" * 500 + '"} -1\n')
    _, rejected = parse_hook(text)
    assert all(line.isprintable() for line in rejected), rejected
    assert rejected[0].startswith("rank 0\\n") and len(rejected[1]) < 200
