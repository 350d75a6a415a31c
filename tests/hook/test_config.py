"""The live forecast on by default where the engine is known (issue 36): the guard's gauge exists without a
variable; MEMTEL_FORECAST_TOKENS=off turns it off, a set value wins, an unknown target keeps it off."""

from __future__ import annotations

import logging

import pytest

from telemetry.hook.config import DEFAULT_FORECAST_TOKENS, HookConfig, forecast_options


@pytest.mark.parametrize("targets", ["vllm-sparse-indexer", "sglang-sparse-indexer"])
def test_a_known_engines_preset_forecasts_by_default(targets):
    config = HookConfig.from_env({"MEMTEL_TARGETS": targets})
    assert config is not None and config.forecast_tokens == DEFAULT_FORECAST_TOKENS


def test_off_turns_it_off_a_value_wins_and_an_unknown_target_stays_off(caplog):
    off = HookConfig.from_env({"MEMTEL_TARGETS": "vllm-sparse-indexer", "MEMTEL_FORECAST_TOKENS": "off"})
    assert off is not None and off.forecast_tokens == ()
    chosen = HookConfig.from_env({"MEMTEL_TARGETS": "vllm-sparse-indexer", "MEMTEL_FORECAST_TOKENS": "4096"})
    assert chosen is not None and chosen.forecast_tokens == (4096,)
    unknown = HookConfig.from_env({"MEMTEL_TARGETS": "json:loads"})
    assert unknown is not None and unknown.forecast_tokens == ()
    with caplog.at_level(logging.ERROR, logger="memtel"):   # a bad value: off with its one line, not the default
        bad = HookConfig.from_env({"MEMTEL_TARGETS": "vllm-sparse-indexer", "MEMTEL_FORECAST_TOKENS": "100k"})
    assert bad is not None and bad.forecast_tokens == () and len(caplog.records) == 1


def test_the_labs_ranks_forecast_by_default():
    assert forecast_options({})["forecast_tokens"] == DEFAULT_FORECAST_TOKENS
    assert forecast_options({"MEMTEL_FORECAST_TOKENS": "off"}) == {}
