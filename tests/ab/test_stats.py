"""Paired statistics: Student's t quantile against published values, the t-interval and the paired difference
on numbers with known answers, and the report's statistics section on a synthetic run written for it."""

from __future__ import annotations

import json
import math

import pytest

from harness.ab.report import Report, compute_metrics, load_run
from harness.ab.report.comparisons import LADDER, comparisons
from harness.ab.report.stats import (
    NO_DATA,
    NO_DIFFERENCE,
    NO_NOISE_ESTIMATE,
    SIGNIFICANT,
    WITHIN_NOISE,
    Estimate,
    PairedDifference,
    t_cdf,
    t_quantile,
)
from tests.ab.synthetic import MIB, Values, ladder, write_run

# Student's t 0.975 quantiles (two-sided 95 %), from published tables (to the digits they give).
T_975 = {1: 12.7062047362, 2: 4.3026527297, 3: 3.1824463053, 4: 2.7764451052, 5: 2.5705818356,
         9: 2.2621571628, 10: 2.2281388520, 29: 2.0452296421, 30: 2.0422724563, 100: 1.9839715185}


@pytest.mark.parametrize("df, expected", sorted(T_975.items()))
def test_t_quantile_matches_the_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-9)
    assert t_cdf(expected, df) == pytest.approx(0.975, abs=1e-9)


def test_t_quantile_other_levels_and_symmetry():
    assert t_quantile(0.995, 5) == pytest.approx(4.0321429836, abs=1e-9)
    assert t_quantile(0.95, 10) == pytest.approx(1.8124611228, abs=1e-9)
    assert t_quantile(0.025, 3) == -t_quantile(0.975, 3)
    assert t_quantile(0.5, 7) == 0.0
    assert t_quantile(0.975, 10**6) == pytest.approx(1.959966, abs=1e-5)  # towards the normal's 1.959964
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError):
            t_quantile(bad, 3)


def test_interval_of_three_values():
    e = Estimate.of([1.0, 1.2, 1.4])
    assert e is not None and e.n == 3 and e.mean == pytest.approx(1.2) and e.sd == pytest.approx(0.2)
    half = 4.3026527297 * 0.2 / math.sqrt(3)
    assert (e.low, e.high) == (pytest.approx(1.2 - half), pytest.approx(1.2 + half))
    one = Estimate.of([5.0, None])
    assert one == Estimate(1, 5.0, None, None, None)  # one value: no sd, no interval
    assert Estimate.of([None]) is None


@pytest.mark.parametrize("a, b, verdict", [
    ([1.0, 1.2, 1.4], [0.5, 0.6, 0.7], SIGNIFICANT),      # differences 0.5, 0.6, 0.7: interval [0.35, 0.85]
    ([1.0, 1.1, 1.2], [1.1, 1.0, 1.3], WITHIN_NOISE),     # differences -0.1, 0.1, -0.1
    ([3.0, 3.0], [1.0, 1.0], SIGNIFICANT),                # the same +2 in every repeat (a simulator's bytes)
    ([3.0, 4.0], [3.0, 4.0], NO_DIFFERENCE),              # identical in every repeat
    ([3.0], [1.0], NO_NOISE_ESTIMATE),                    # one repeat
    ([None, 2.0], [1.0, None], NO_DATA),                  # no pair with both values
])
def test_paired_difference_verdicts(a, b, verdict):
    d = PairedDifference.of("a", "b", dict(enumerate(zip(a, b, strict=True))))
    assert d.verdict == verdict


def test_paired_difference_known_interval():
    d = PairedDifference.of("a", "b", {0: (1.0, 0.5), 1: (1.2, 0.6), 2: (1.4, 0.7), 3: (None, 1.0)})
    assert d.repeats == [0, 1, 2]  # the pair with a missing value is left out
    assert d.estimate is not None and d.estimate.mean == pytest.approx(0.6) and d.estimate.sd == pytest.approx(0.1)
    half = 4.3026527297 * 0.1 / math.sqrt(3)
    assert (d.estimate.low, d.estimate.high) == (pytest.approx(0.6 - half), pytest.approx(0.6 + half))


def synthetic_values() -> dict:
    ttft = {("a", "s1"): [1.0, 1.2, 1.4], ("b", "s1"): [0.5, 0.6, 0.7],
            ("a", "s2"): [1.0, 1.1, 1.2], ("b", "s2"): [1.1, 1.0, 1.3]}
    growth = {("a", "s1"): 100.0, ("b", "s1"): 20.0, ("a", "s2"): 0.0, ("b", "s2"): 0.0}
    low = {("a", "s1"): [300.0, 320.0, 340.0], ("b", "s1"): [100.0, 110.0, 120.0],
           ("a", "s2"): [50.0, 60.0, 70.0], ("b", "s2"): [55.0, 60.0, 65.0]}
    return {(arm, r, step): Values(ttft_s=ttft[(arm, step)][r], reserved_growth_mib=growth[(arm, step)],
                                   low_point_mib=low[(arm, step)][r])
            for arm in ("a", "b") for step in ("s1", "s2") for r in range(3)}


def test_statistics_of_a_synthetic_run_with_known_answers(tmp_path):
    write_run(tmp_path, synthetic_values(), ladder(["a", "b"], ["s1", "s2"], repeats=3))
    metrics = compute_metrics(load_run(tmp_path))
    found = {(c.metric, c.step): c for c in comparisons(metrics)}
    ttft = found[("ttft_client_s", "s1")]
    assert ttft.arms["a"] == Estimate.of([1.0, 1.2, 1.4]) and ttft.arms["b"] == Estimate.of([0.5, 0.6, 0.7])
    assert ttft.differences[0].verdict == SIGNIFICANT
    assert ttft.differences[0].estimate.mean == pytest.approx(0.6)
    assert found[("ttft_client_s", "s2")].differences[0].verdict == WITHIN_NOISE
    growth = found[("reserved_growth_bytes", "s1")]
    assert growth.arms["a"].mean == 100 * MIB and growth.arms["a"].sd == 0
    assert growth.differences[0].verdict == SIGNIFICANT and growth.differences[0].estimate.mean == 80 * MIB
    assert found[("reserved_growth_bytes", "s2")].differences[0].verdict == NO_DIFFERENCE
    ladder_total = found[("reserved_growth_bytes", LADDER)]
    assert ladder_total.arms["b"].mean == 20 * MIB and ladder_total.differences[0].estimate.mean == 80 * MIB
    low = found[("mem_available_min_delta_bytes:n0", "s1")]
    assert low.arms["a"].mean == pytest.approx(-320 * MIB) and low.arms["a"].sd == pytest.approx(20 * MIB)
    assert low.differences[0].estimate.mean == pytest.approx(-210 * MIB)  # -320 - (-110)
    assert found[("mem_available_min_delta_bytes:n0", "s2")].differences[0].verdict == WITHIN_NOISE

    report = Report.build(tmp_path)
    text = report.write().read_text()
    section = text.split("## 5. Differences between the arms")[1].split("\n## ")[0]
    assert "t(0.975, n − 1)" in section and "paired" in section
    row = "| s1 | 1.200 ± 0.497 (sd 0.200) | 0.600 ± 0.248 (sd 0.100) | +0.600 s (significant), 95 % [+0.352, +0.848] |"
    assert row in section
    assert "| s2 |" in section and "(within the noise)" in section
    assert "| over the ladder | +100.0 ± 0.0 (sd 0.0) | +20.0 ± 0.0 (sd 0.0) | +80.0 MiB (significant) |" in section
    assert "a − b reserved growth over the ladder, all ranks: +80.0 MiB (significant: the same in all 3 repeats)" \
        in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    data = summary["sections"]["statistics"]
    assert data["confidence"] == 0.95 and data["repeats"] == 3
    s1 = next(c for c in data["comparisons"] if c["metric"] == "ttft_client_s" and c["step"] == "s1")
    assert s1["arms"]["a"]["mean"] == pytest.approx(1.2) and s1["differences"][0]["verdict"] == SIGNIFICANT
    assert isinstance(s1["differences"][0]["estimate"]["low"], float)  # numbers in JSON, not text


def test_one_repeat_says_no_noise_estimate_exists(tmp_path):
    values = {k: v for k, v in synthetic_values().items() if k[1] == 0}
    write_run(tmp_path, values, ladder(["a", "b"], ["s1", "s2"], repeats=1))
    text = Report.build(tmp_path).write().read_text()
    assert "**One repeat: no noise estimate exists.**" in text
    assert "+0.500 s (one repeat: no noise estimate)" in text
    verdict_line = text.splitlines()[2]
    assert "reserved growth over the ladder, all ranks: +80.0 MiB (one repeat: no noise estimate)" in verdict_line
