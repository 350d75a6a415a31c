"""`pytest -m gpu` collects on a box without the optional extras (issue 40): the GPU run on the device machine
stopped with 4 collection errors where test modules imported `openai` (the `test` extra) at their top. Here the
whole suite is collected by a Python that cannot import any module of tests/support/extras.py's EXTRA_OF."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.extras import BLOCK_EXTRAS_SITECUSTOMIZE, EXTRA_OF

ROOT = Path(__file__).resolve().parents[1]


def test_pytest_m_gpu_collects_with_every_optional_extra_absent(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK_EXTRAS_SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    blocked = subprocess.run([sys.executable, "-c", "import importlib.util, sys; "
                              f"sys.exit(any(importlib.util.find_spec(m) for m in {sorted(EXTRA_OF)!r}))"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert blocked.returncode == 0, f"the blocker let an extra be found: {blocked.stderr}"
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q",
                             "-p", "no:cacheprovider", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr
    assert result.returncode == 0 and "error" not in summary, result.stdout[-3000:] + result.stderr[-2000:]
    assert " tests collected" in summary and not summary.startswith("0/"), summary
