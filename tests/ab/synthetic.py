"""Synthetic run directories with known answers: results.jsonl written from values the test chooses.

`write_run(run_dir, values, ...)` writes a complete run of url arms (no servers): for each block a baseline
scrape, then per step a request with the given TTFT, node samples, and an after scrape whose rank shows the
given reserved growth and whose node shows the given MemAvailable low point and NV_ERR lines. Timestamps are
explicit (one request per 10 s), so the report's "scrape before the request" is exactly the one intended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.ab.config import Ladder
from harness.ab.records import (
    NodeSample,
    NodeSnapshot,
    RankSnapshot,
    Record,
    RequestDone,
    RunEnd,
    RunStart,
    Scrape,
    ServerSnapshot,
)

MIB = 1 << 20
GIB = 1 << 30
BASE_AVAILABLE = 10 * GIB


@dataclass(frozen=True)
class Values:
    """What one request did (the numbers a test expects back)."""

    ttft_s: float
    reserved_growth_mib: float = 0.0
    low_point_mib: float = 0.0  # MemAvailable's lowest point during the request, MiB below its start
    nv_err: int = 0
    headroom_low_mib: float | None = None  # lowest unified headroom during the request (absolute MiB)
    ok: bool = True


def ladder(arms: list[str], steps: list[str], repeats: int, gates: list | None = None) -> Ladder:
    data: dict = {"model": "m",
                  "arms": [{"name": a, "url": f"http://127.0.0.1:{9000 + i}"} for i, a in enumerate(arms)],
                  "nodes": {"n0": "http://127.0.0.1:9100/metrics"}, "ranks": {"rank0": "http://127.0.0.1:9200/metrics"},
                  "steps": [{"label": s, "tokens": 1000 * (i + 1), "seed": i + 1} for i, s in enumerate(steps)],
                  "repeats": repeats, "order": "ABAB"}
    if gates is not None:
        data["gates"] = gates
    return Ladder.from_dict(data, source="synthetic.yaml")


def write_run(run_dir: Path, values: dict[tuple[str, int, str], Values], the_ladder: Ladder,
              status: str = "complete") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    out: list[Record] = [RunStart(ts=1.0, resumed=False, ladder=the_ladder, ladder_source="synthetic.yaml",
                                  environment={"memtel_version": "test"})]
    clock = 100.0
    for repeat in range(the_ladder.repeats):
        for arm in [a.name for a in the_ladder.arms]:
            reserved = 1 * GIB
            nv_err = 0
            out.append(Scrape(ts=clock, phase="baseline", arm=arm, repeat=repeat, step=None,
                              nodes={"n0": NodeSnapshot(ts=clock, mem_available_bytes=BASE_AVAILABLE,
                                                        nv_err_no_memory_total=0,
                                                        unified_headroom_bytes=BASE_AVAILABLE)},
                              ranks={"rank0": RankSnapshot(ts=clock, reserved_bytes=reserved)},
                              server=ServerSnapshot(ts=clock)))
            for step in the_ladder.steps:
                v = values.get((arm, repeat, step.label))
                if v is None:
                    continue
                started = clock + 1.0
                low = BASE_AVAILABLE - v.low_point_mib * MIB
                headroom = v.headroom_low_mib * MIB if v.headroom_low_mib is not None else None
                sample = NodeSnapshot(ts=started + 1.0, mem_available_bytes=low, unified_headroom_bytes=headroom)
                out.append(NodeSample(ts=started + 1.0, arm=arm, repeat=repeat, step=step.label, node="n0",
                                      snapshot=sample))
                out.append(RequestDone(ts=started + 3.0, arm=arm, repeat=repeat, step=step.label, seed=step.seed,
                                       target_tokens=step.tokens, prompt_tokens=step.tokens, prompt_sha256="x",
                                       ok=v.ok, error=None if v.ok else "HTTP 500: boom", started_at=started,
                                       ended_at=started + 2.0, ttft_s=v.ttft_s if v.ok else None,
                                       e2e_s=v.ttft_s + 0.1 if v.ok else None,
                                       min_mem_available_bytes={"n0": low}, node_samples=1))
                reserved += int(v.reserved_growth_mib * MIB)
                nv_err += v.nv_err
                out.append(Scrape(ts=started + 4.0, phase="after", arm=arm, repeat=repeat, step=step.label,
                                  nodes={"n0": NodeSnapshot(ts=started + 4.0, mem_available_bytes=BASE_AVAILABLE,
                                                            nv_err_no_memory_total=nv_err,
                                                            unified_headroom_bytes=BASE_AVAILABLE)},
                                  ranks={"rank0": RankSnapshot(ts=started + 4.0, reserved_bytes=reserved)},
                                  server=ServerSnapshot(ts=started + 4.0)))
                clock += 10.0
    out.append(RunEnd(ts=clock + 1.0, status=status))
    path = run_dir / "results.jsonl"
    path.write_text("".join(json.dumps(r.to_json(), allow_nan=False) + "\n" for r in out))
    return path
