"""Suite-wide fixtures and markers.

Markers (pyproject.toml): `gpu` tests are skipped where torch.cuda is unavailable (CI has no GPU;
they run on the device machine). `kmsg` tests write into the machine's kernel log and run only with
MEMTEL_TEST_KMSG=1 (CI's .ci/run sets it; tests/support/kmsg.py). `vllm` and `prometheus` tests are
never skipped: scripts/test installs what they need, and a missing part fails them with a message
that says how to get it. A test module that imports a package of an optional extra (httpx, bcrypt, ...)
is skipped, with the extra to install, where that package is missing (tests/support/extras.py), so
`pytest -m gpu` collects on a CUDA machine with torch and memtel's core dependencies only.

Tiers (docs/testing.md): `scripts/test --fast` leaves out the markers in FAST_TIER_LEAVES_OUT.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.extras import missing_extra

# What `scripts/test --fast` leaves out (its -m expression is built from this in scripts/test).
FAST_TIER_LEAVES_OUT = ("slow", "vllm", "kmsg", "network")


class _ModuleOfAnExtra(pytest.Module):
    """A test module whose import of a missing optional extra becomes a skip of the module, with its reason."""

    def _getobj(self):
        try:
            return super()._getobj()
        except self.CollectError as error:
            reason = missing_extra(error.__cause__)
            if reason is None:
                raise
            pytest.skip(f"{self.path.name}: {reason}", allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module:
    return _ModuleOfAnExtra.from_parent(parent, path=module_path)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    from tests.support.kmsg import SKIP_REASON, opted_in

    if not opted_in():
        skip_kmsg = pytest.mark.skip(reason=SKIP_REASON)
        for item in items:
            if "kmsg" in item.keywords:
                item.add_marker(skip_kmsg)
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu): run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model():
    """A random-weight 2-layer, hidden-128 Llama with a WordLevel tokenizer, made once per machine at a fixed path
    (tests/support/vllm.py: vLLM's compile cache is keyed by the model's path)."""
    from tests.support.vllm import cached_tiny_llama

    return cached_tiny_llama()
