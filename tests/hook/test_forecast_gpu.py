"""The live forecast in a real CUDA process (marker gpu: run on the device machine).

tests/hook/forecast_process.py, with the hook's forecast on and the CUDA caching allocator, under a few
allocator settings and both width modes: after resident blocks and a first stock (or fixed) prefill, the
forecast the exporter serves equals `forecast()` run on a `torch.cuda.memory_snapshot()` taken at the same
point, and the next prefill of each length adds exactly the forecast reserved growth and device allocs and
reaches exactly the forecast peak. The same script runs on the simulator in the CPU suite
(test_forecast.py::test_the_forecast_process_on_the_simulator).
"""

from __future__ import annotations

import json

import pytest

from tests.hook.forecast_process import check_exact, run_forecast_process

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("mode", "alloc_conf"), [("stock", None), ("fixed", None),
                                                  ("stock", "expandable_segments:True"),
                                                  ("stock", "max_split_size_mb:256"),
                                                  ("fixed", "expandable_segments:True")])
def test_the_exported_forecast_equals_a_snapshot_forecast_and_the_next_prefill(mode, alloc_conf):
    pytest.importorskip("torch")
    out = run_forecast_process("cuda", mode, alloc_conf)
    assert out["alloc_conf"] == (alloc_conf or "")
    print(json.dumps(out))
    check_exact(out, peak=True)
