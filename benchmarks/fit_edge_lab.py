"""The gauge against the real edge on the lab's emulated unified memory (`memtel lab serve --capacity-gb`), one and
two ranks (issue 32, item 4).

    PYTHONPATH=. python3 benchmarks/fit_edge_lab.py [--out fit-edge-lab.json] [--parallel 2]

For each rank count a fresh lab server (sim allocator, the node's capacity emulated, the live forecast on) is
started per prompt length: it reads `memtel_forecast_max_prefill_tokens` at rest, then serves one completion
of exactly that many tokens (200: it fit; 500 with the engine dead: the node ran out of memory). The search
starts at the gauge, checks it and one token more, then walks and bisects to the longest prompt that was served
and the first that killed the node, one token apart. The shape and capacities are tests/labserver/
test_capacity.py's (4 layers, 1,024-token chunks, max-model-len 65,536, 64 MiB logits budget; 60 MiB for one rank,
120 MiB for two).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.labserver.conftest import LabServer  # noqa: E402  (the lab server as its tests start it)
from tests.labserver.test_capacity import ENV, SHAPE, complete, fit_after  # noqa: E402

MIB = 1 << 20
TOP = 65_536 - 1   # the longest prompt max-model-len allows with max_tokens 1
CAPACITY = {1: 60 * MIB, 2: 120 * MIB}


def served(ranks: int, tokens: int, tmp: Path) -> dict[str, Any]:
    """A fresh node: the gauge at rest, then one prompt of `tokens`."""
    server = LabServer(tmp, *SHAPE, "--capacity-gb", str(CAPACITY[ranks] / (1 << 30)), ranks=ranks, env=ENV)
    with server:
        gauge = min(fit_after(server, rank, 0)[0] for rank in range(ranks))
        response = complete(server, tokens, "a")
    return {"tokens": tokens, "status": response.status_code, "gauge": gauge}


def search(ranks: int, tmp: Path, parallel: int) -> dict[str, Any]:
    probes: dict[int, dict[str, Any]] = {}

    def run(lengths: list[int]) -> None:
        with ThreadPoolExecutor(parallel) as pool:
            for result in pool.map(lambda n: served(ranks, n, tmp), lengths):
                probes[result["tokens"]] = result
                print(f"  {ranks} rank(s) {result['tokens']:>6,}: {result['status']} (gauge {result['gauge']:,})",
                      flush=True)

    first = served(ranks, 1, tmp)
    gauge = first["gauge"]
    run([gauge, gauge + 1])
    lo = gauge if probes[gauge]["status"] == 200 else None
    hi = gauge + 1 if probes[gauge + 1]["status"] != 200 else None
    lo = gauge + 1 if hi is None else lo
    step = 1024
    while hi is None and lo is not None and lo < TOP:
        candidate = min(TOP, lo + step)
        run([candidate])
        lo, hi = (candidate, None) if probes[candidate]["status"] == 200 else (lo, candidate)
        step *= 2
    while lo is None:
        candidate = max(1, (hi or gauge) - step)
        run([candidate])
        lo, hi = (candidate, hi) if probes[candidate]["status"] == 200 else (None, candidate)
        step *= 2
    while hi is not None and hi - lo > 1:
        middle = (lo + hi) // 2
        run([middle])
        lo, hi = (middle, hi) if probes[middle]["status"] == 200 else (lo, middle)
    return {"ranks": ranks, "capacity": CAPACITY[ranks], "gauge": gauge, "longest_served": lo, "first_dead": hi,
            "probes": sorted(probes.values(), key=lambda p: p["tokens"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("fit-edge-lab.json"))
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--ranks", default="1,2")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (int(r) for r in args.ranks.split(",")):
            started = time.monotonic()
            case = search(ranks, Path(tmp), args.parallel)
            case["seconds"] = round(time.monotonic() - started, 1)
            report["cases"].append(case)
            print(f"{ranks} rank(s), {CAPACITY[ranks] // MIB} MiB: gauge {case['gauge']:,}; longest served "
                  f"{case['longest_served']:,}, first that killed the node {case['first_dead']} "
                  f"({case['seconds']} s)", flush=True)
    args.out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
