"""The demo's section leads with the result (each arm's growth, the prediction's agreement), then the details."""

from __future__ import annotations

from types import SimpleNamespace

from harness.demo.notes import result_line

MIB = 1 << 20


def request(arm, step, growth_mib, allocs):
    ranks = {r: SimpleNamespace(reserved_growth_bytes=growth_mib * MIB, num_device_alloc=allocs) for r in ("r0", "r1")}
    return SimpleNamespace(arm=arm, repeat=0, step=step, ranks=ranks)


def test_the_result_line_sums_each_arms_growth_and_counts_the_agreeing_steps():
    steps = {"stock": [(4608, 16), (0, 0), (2, 1)], "fixed": [(1024, 2), (0, 0), (0, 0)]}
    requests = {(arm, 0, i): request(arm, i, g, a) for arm, rows in steps.items() for i, (g, a) in enumerate(rows)}
    metrics = SimpleNamespace(run=SimpleNamespace(arms=["stock", "fixed"]), requests=requests)
    notes = SimpleNamespace(arms={"stock": [SimpleNamespace(agree=True)] * 3,
                                  "fixed": [SimpleNamespace(agree=True), SimpleNamespace(agree=False)]})
    line = result_line(metrics, notes)
    assert line.startswith("**Result:**")
    assert "**stock** reserved +4,610 MiB in 17 device allocations" in line
    assert "**fixed** reserved +1,024 MiB in 2 device allocations" in line and "on 4 of 5 steps" in line
