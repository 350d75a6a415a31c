"""`--cap device|fraction` means the same in `memtel forecast` and `memtel tune`: the same snapshot and memory give
the same longest fit for today's setting, and under a fraction a garbage-collection threshold acts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import call_main

SNAPSHOT = (Path(__file__).resolve().parents[1] / "fixtures" / "allocator-snapshots" / "h200-torch2.11"
            / "seeded-default-stock-state24k.snapshot.json.gz")   # a real H200 snapshot (test_tune.py's)

SHAPE_ARGS = ["--layers", "4", "--chunk", "8192", "--compress-ratio", "4", "--max-model-len", "32768",
              "--budget-mb", "512"]
MEMORY = ["--total-memory-gb", "139.8"]


def _forecast_fit(cap: str, gb: str, conf: str = "") -> int:
    done = call_main(["forecast", "--snapshot", str(SNAPSHOT), "--max-fit", "--capacity-gb", gb, "--cap", cap,
                      "--alloc-conf", conf, *MEMORY, *SHAPE_ARGS, "--json"])
    assert done.returncode == 0, done.stderr
    return int(json.loads(done.stdout)["max_fit"]["tokens"])


def _tune_now(cap: str, gb: str, conf: str = "") -> int:
    done = call_main(["tune", "--snapshot", str(SNAPSHOT), "--target-tokens", "8192", "--memory-gb", gb,
                      "--cap", cap, "--alloc-conf", conf, *MEMORY, *SHAPE_ARGS, "--expandable-segments", "False",
                      "--max-split-mb", "none", "--roundup", "none", "--gc-threshold", "none", "--budgets-mb",
                      "512", "--chunks", "8192", "--modes", "stock", "--json"])
    assert done.returncode == 0, done.stderr
    return int(json.loads(done.stdout)["process"]["max_fit_tokens"])


@pytest.mark.parametrize("cap", ["device", "fraction"])
def test_forecast_and_tune_agree_under_each_cap(cap: str) -> None:
    assert _forecast_fit(cap, "6.9") == _tune_now(cap, "6.9")


def test_forecast_under_the_fraction_simulates_it_with_the_processs_settings() -> None:
    done = call_main(["forecast", "--snapshot", str(SNAPSHOT), "--tokens", "15000", "--capacity-gb", "6.9", "--cap",
                      "fraction", "--alloc-conf", "garbage_collection_threshold:0.5", *MEMORY, *SHAPE_ARGS, "--json"])
    assert done.returncode == 0, done.stderr
    conf = json.loads(done.stdout)["forecasts"][0]["alloc_conf"]
    assert conf.startswith("garbage_collection_threshold:0.5,per_process_memory_fraction:0.04935")   # 6.9 / 139.8


def test_forecast_cap_fraction_refuses_a_second_fraction() -> None:
    done = call_main(["forecast", "--snapshot", str(SNAPSHOT), "--max-fit", "--capacity-gb", "6.9", "--cap",
                      "fraction", "--alloc-conf", "per_process_memory_fraction:0.5", *SHAPE_ARGS])
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "already set" in done.stderr
