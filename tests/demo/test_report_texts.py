"""Issue 19, item 10: the demo report's texts and its TTFT image say what ran and what it means.

Before: the TTFT plot showed the arms' gap with no caveat in the image (the text said it is not the fix's
effect, the picture did not); the header said `order AABB` while the statistics said the pairs ran side by
side in `order: ABAB`; "Verdict: OK" meant only "the requests completed"; chunk steps counted from 1 in the
report and from 0 in `memtel replay` / `memtel forecast`. Synthetic run directories (tests/ab/synthetic.py).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from harness.ab.config import Ladder
from harness.ab.report import Report
from harness.ab.report.plots import ONE_REPEAT, ttft_caveat, ttft_figure
from harness.demo.notes import TTFT_CAVEAT, _steps_with_growth
from telemetry.model.indexer.planner import plan_prefill
from telemetry.model.indexer.shape import REFERENCE_SHAPE
from tests.ab.synthetic import Values, write_run


def _ladder(order: str, repeats: int, gates: list | None = None) -> Ladder:
    data: dict = {"model": "m", "arms": [{"name": a, "url": f"http://127.0.0.1:{9000 + i}"}
                                         for i, a in enumerate(("stock", "fixed"))],
                  "nodes": {"n0": "http://127.0.0.1:9100/metrics"}, "ranks": {"rank0": "http://127.0.0.1:9200/metrics"},
                  "steps": [{"label": "s1", "tokens": 1000, "seed": 1}], "repeats": repeats, "order": order}
    if gates is not None:
        data["gates"] = gates
    return Ladder.from_dict(data, source="synthetic.yaml")


def _run(tmp_path, order: str, repeats: int, gates: list | None = None) -> Report:
    values = {(arm, r, "s1"): Values(ttft_s=7.25 if arm == "stock" else 2.79, reserved_growth_mib=10.0)
              for arm in ("stock", "fixed") for r in range(repeats)}
    write_run(tmp_path, values, _ladder(order, repeats, gates))
    return Report.build(tmp_path)


def test_the_report_says_abab_where_aabb_ran(tmp_path):
    text = _run(tmp_path, "AABB", 2).write().read_text()
    assert "order AABB" in text.split("\n## ")[0]  # the header
    statistics = text.split("5. Differences between the arms")[1]
    assert "this run's `order: AABB`" in statistics
    assert "run side by side in `order: ABAB`" not in text


def test_verdict_ok_only_meant_the_requests_completed(tmp_path):
    report = _run(tmp_path / "none", "ABAB", 2)
    assert report.verdict.outcome == "COMPLETED" and report.verdict.exit_code == 0
    line = report.write().read_text().splitlines()[2]
    assert line.startswith("**Verdict: COMPLETED** — 4 of 4 requests ok; no gates, so nothing was judged")
    assert "Verdict: OK" not in (tmp_path / "none" / "report.md").read_text()
    gated = _run(tmp_path / "gated", "ABAB", 2, gates=[{"max_nv_err_events": 0}])
    assert gated.verdict.outcome == "PASS" and "nothing was judged" not in gated.verdict.line


def test_the_ttft_plot_has_no_caveat_in_the_image(tmp_path):
    report = _run(tmp_path, "AABB", 1)
    caveat = ttft_caveat(report.metrics, {"ttft": TTFT_CAVEAT[True]})
    assert caveat is not None and caveat.startswith(TTFT_CAVEAT[True]) and caveat.endswith(ONE_REPEAT)
    figure = ttft_figure(plt, report.metrics, ["C0", "C1"], caveat)
    try:
        drawn = " ".join(t.get_text().replace("\n", " ") for t in figure.texts)
        assert "NOT the fix's effect" in drawn and "no noise estimate" in drawn
    finally:
        plt.close(figure)
    two = _run(tmp_path / "two", "ABAB", 2)
    assert ttft_caveat(two.metrics, None) is None  # nothing to say: no box


def test_chunk_steps_count_from_one_in_the_report():
    first_index = plan_prefill(3 * REFERENCE_SHAPE.chunk, REFERENCE_SHAPE, "stock")[0][0].index
    assert first_index == 0  # how replay and forecast number the first chunk
    assert _steps_with_growth([5, 0, 7, 0]) == "0, 2 of 4"
    assert _steps_with_growth([5, 5, 0]) == "0–1 of 3"
