"""Suite-wide fixtures and markers.

Markers (pyproject.toml): `gpu` tests are skipped where torch.cuda is unavailable (CI has no GPU;
they run on the device machine). `vllm`, `prometheus` and `kmsg` tests are never skipped: scripts/test
installs what they need, and a missing part fails them with a message that says how to get it.
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
