"""The test tiers (docs/testing.md): `scripts/test --fast` leaves out exactly the markers tests/conftest.py names,
each of them is a marker pyproject.toml declares, and a test module that imports a missing optional extra is
skipped with the extra's name instead of failing collection."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST_TIER_LEAVES_OUT
from tests.support.extras import EXTRA_OF, missing_extra

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")


def test_the_fast_tier_leaves_out_the_markers_conftest_names():
    script = (ROOT / "scripts" / "test").read_text()
    (expression,) = re.findall(r'-m "([^"]+)"', script)
    assert expression == " and ".join(f"not {marker}" for marker in FAST_TIER_LEAVES_OUT)
    declared = {line.split(":")[0] for line in tomllib.loads((ROOT / "pyproject.toml").read_text())
                ["tool"]["pytest"]["ini_options"]["markers"]}
    assert set(FAST_TIER_LEAVES_OUT) <= declared
    assert "--durations=25" in script  # CI (.ci/run runs scripts/test) prints the 25 slowest tests


def test_every_optional_module_belongs_to_an_extra_of_pyproject():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in EXTRA_OF.items():
        assert any(re.match(rf"{module}\b", requirement, re.IGNORECASE) for requirement in extras[extra]), module


def test_only_a_missing_module_of_an_extra_becomes_a_skip():
    absent = ModuleNotFoundError("No module named 'bcrypt'", name="bcrypt")
    present = ModuleNotFoundError("No module named 'yaml.x'", name="yaml.x")  # core, and installed
    typo = ModuleNotFoundError("No module named 'telemetry.nope'", name="telemetry.nope")
    reason = missing_extra(absent)
    has_bcrypt = subprocess.run([sys.executable, "-c", "import bcrypt"], capture_output=True).returncode == 0
    assert (reason is None) == has_bcrypt  # installed here: a real import error of it is not hidden
    if reason is not None:
        assert "pip install 'memtel[auth]'" in reason
    assert missing_extra(present) is None and missing_extra(typo) is None
    assert missing_extra(ImportError("cannot import name 'x'")) is None


def test_a_module_needing_a_missing_extra_is_skipped_with_its_reason(tmp_path):
    (tmp_path / "test_needs_extra.py").write_text("import memtel_no_such_extra_module\n\ndef test_x():\n    pass\n")
    (tmp_path / "test_broken.py").write_text("import memtel_no_such_core_module\n\ndef test_y():\n    pass\n")
    conftest = (
        "import tests.support.extras as extras\n"
        "extras.EXTRA_OF['memtel_no_such_extra_module'] = 'harness'\n"
        "from tests.conftest import pytest_pycollect_makemodule  # noqa: F401\n"
    )
    (tmp_path / "conftest.py").write_text(conftest)
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q", "--rootdir",
                             str(tmp_path), "-c", "/dev/null", str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = result.stdout
    assert ("test_needs_extra.py: needs 'memtel_no_such_extra_module' from memtel's 'harness' extra, which is not "
            "installed: pip install 'memtel[harness]'") in out, out
    assert "ERROR" in out and "memtel_no_such_core_module" in out, out  # an import error of anything else stays one
    assert result.returncode != 0


def test_tests_that_share_a_resource_run_in_one_worker_and_the_longest_groups_go_first(
        request: pytest.FixtureRequest) -> None:
    """scripts/test's workers (docs/testing.md, "Workers"): a test that writes into the kernel log, uses a shared
    vLLM launch or the live Prometheus stack is in that resource's group (else two workers would share or
    double it); a group's tests are next to each other; the groups named to go first do."""
    from tests.conftest import _SHARED_VLLM, LONGEST_FIRST, SHARED_GROUPS, worker_group

    for name in LONGEST_FIRST:
        assert name in SHARED_GROUPS or (ROOT / name).is_file(), f"LONGEST_FIRST names {name}: no such group"
    for modules in SHARED_GROUPS.values():
        assert all((ROOT / module).is_file() for module in modules), modules
    needs = {"kmsg": lambda item: item.get_closest_marker("kmsg") is not None,
             "vllm-shared": lambda item: bool(_SHARED_VLLM & set(item.fixturenames)),
             "live-stack": lambda item: "live_stack" in item.fixturenames}
    groups: list[str] = []
    for item in request.session.items:
        group = worker_group(item.nodeid)
        for shared, uses in needs.items():
            assert not uses(item) or group == shared, \
                f"{item.nodeid} needs {shared}: add its module to SHARED_GROUPS[{shared!r}] in tests/conftest.py"
        if not groups or groups[-1] != group:
            groups.append(group)
    assert len(groups) == len(set(groups)), f"a group's tests are apart: {groups}"
    first = [g for g in groups if g in LONGEST_FIRST]
    assert groups[:len(first)] == sorted(first, key=LONGEST_FIRST.index)


@pytest.mark.parametrize("workers", ["two", "-1", "2 "])
def test_a_bad_worker_count_is_one_line_and_exit_2_before_any_set_up(workers: str, tmp_path: Path) -> None:
    """MEMTEL_TEST_WORKERS is checked before scripts/test sets anything up (no venv, no apt, no pytest)."""
    env = {**os.environ, "MEMTEL_TEST_WORKERS": workers}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "test"), "--fast", "tests/test_ports.py"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("scripts/test: MEMTEL_TEST_WORKERS must be a whole number (0: no workers), "
                             f"not '{workers}'\n")


def test_the_suite_collects_without_xdist() -> None:
    """A CUDA machine with the core dependencies only (`pytest -m gpu`) has no pytest-xdist: the conftest's
    scheduler hook must not stop collection there."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider",
                             "--collect-only", "-q", "-m", "gpu", "tests/hook"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "test_forecast_gpu.py" in result.stdout
