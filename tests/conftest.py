"""Suite-wide fixtures and markers.

Markers (pyproject.toml): `gpu` tests are skipped where torch.cuda is unavailable (CI has no GPU;
they run on the device machine). `kmsg` tests write into the machine's kernel log and run only with
MEMTEL_TEST_KMSG=1 (CI's .ci/run sets it; tests/support/kmsg.py). `vllm` and `prometheus` tests are
never skipped: scripts/test installs what they need, and a missing part fails them with a message
that says how to get it.
"""

from __future__ import annotations

import pytest


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
def tiny_model(tmp_path_factory):
    """A random-weight 2-layer, hidden-128 Llama with a WordLevel tokenizer, made once per session."""
    from tests.support.vllm import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
