"""The truth capture's generated cases (telemetry/model/capture/truth.py): deterministic, well-formed, and the ones
the fixtures hold."""

from __future__ import annotations

import json
from pathlib import Path

from telemetry.model.allocsim.ops import replay_ops
from telemetry.model.capture.truth import CONFIGS, build_cases, config_slug

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "allocator-truth"


def test_cases_are_deterministic_and_replayable():
    first, second = build_cases(), build_cases()
    assert first == second
    kinds = {op[0] for ops in first.values() for op in ops}
    assert kinds == {"malloc", "free", "empty_cache"}
    for name, ops in first.items():
        rows = replay_ops(ops, case=name)
        assert rows[-1][1] == 0, f"{name} leaves memory allocated"  # every case frees what it allocated


def test_fixtures_hold_exactly_the_generated_ops_for_every_config():
    cases = build_cases()
    for config in CONFIGS:
        doc = json.loads((FIXTURES / f"h200-torch2.11-{config_slug(config)}.json").read_text())
        assert doc["config"] == config
        assert doc["torch"].startswith("2.11")
        assert {name: case["ops"] for name, case in doc["cases"].items()} == cases


def test_config_slugs_are_file_name_safe():
    assert config_slug("") == "default"
    assert config_slug("roundup_power2_divisions:[256:1,>:8]") == "roundup-power2-divisions-256-1-8"
