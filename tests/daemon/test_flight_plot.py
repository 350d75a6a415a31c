"""Issue 19, item 10 (flight plot): `memtel flight show --plot` hid the headroom line under another and did not
draw the floor.

Before: the headroom, often equal to MemAvailable or to the contiguous memory, was drawn first and as thin as
the others (and GPU power's twin axis was drawn over all of them); the falling alert's floor (25 % of
MemTotal, telemetry/procfs/headroom.py FALLING) and MemtelUnifiedHeadroomLow's 4 GiB were not drawn at all.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from telemetry.flight.cli import HEADROOM_LOW_FLOOR_BYTES, draw
from telemetry.flight.recorder import HEADROOM_SERIES
from telemetry.flight.ring import Record, RingContents, RingHeader
from telemetry.procfs.headroom import FALLING

GIB = 1024**3
ROOT = Path(__file__).resolve().parents[2]


def _contents() -> RingContents:
    records = []
    for i in range(30):
        available = (40 - max(0, i - 15)) * GIB
        records.append(Record(i, 1_800_000_000.0 + i, {
            HEADROOM_SERIES: available,  # the headroom equals MemAvailable: the case that hid it
            "memtel_node_mem_available_bytes": available,
            "memtel_node_mem_free_contiguous_bytes": 50 * GIB,
            "memtel_node_mem_total_bytes": 120 * GIB,
            'memtel_gpu_power_watts{gpu="0",uuid="GPU-1"}': 40.0 + i}))
    return RingContents(RingHeader("boot-a", 60, 4096, 1.0), records)


def test_the_flight_plot_hides_the_headroom_and_draws_no_floor():
    contents = _contents()
    figure = draw(plt, contents, contents.records)
    try:
        axes, twin = figure.axes
        lines = {line.get_label(): line for line in axes.get_lines()}
        headroom = lines["headroom"]
        others = [line for label, line in lines.items() if label != "headroom"]
        assert all(headroom.get_zorder() > line.get_zorder() for line in others)
        assert headroom.get_linewidth() > max(line.get_linewidth() for line in others)
        assert axes.get_zorder() > twin.get_zorder()  # the power axis is beneath the memory series
        floors = {label: set(line.get_ydata()) for label, line in lines.items() if "floor" in label}
        assert sorted(floors.values(), key=min) == [{4.0}, {FALLING.floor_ratio * 120}]  # GiB
        legend = [text.get_text() for text in axes.get_legend().get_texts()]
        assert legend[0] == "headroom" and any("floor" in t for t in legend) and any("GPU power" in t for t in legend)
    finally:
        plt.close(figure)


def test_the_plots_headroom_floor_is_the_alerts():
    rules = yaml.safe_load((ROOT / "dashboards" / "prometheus" / "memtel-alerts.yml").read_text())
    (expr,) = [rule["expr"] for group in rules["groups"] for rule in group["rules"]
               if rule.get("record") == "memtel:unified_headroom_low_threshold_bytes"]
    factors = re.fullmatch(r"\s*vector\(([\d\s*]+)\)\s*", expr).group(1).split("*")
    assert math.prod(int(f) for f in factors) == HEADROOM_LOW_FLOOR_BYTES
