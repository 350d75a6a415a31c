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

import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from tests.support.extras import missing_extra

if TYPE_CHECKING:   # imported by the fixtures when used: it needs httpx (the harness extra)
    from tests.support.vllm_shared import SharedServers, SharedVllm

# What `scripts/test --fast` leaves out (its -m expression is built from this in scripts/test).
FAST_TIER_LEAVES_OUT = ("slow", "vllm", "kmsg", "network")


class _ModuleOfAnExtra(pytest.Module):
    """A test module whose import of a missing optional extra becomes a skip of the module, with its reason."""

    def _getobj(self) -> ModuleType:
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


# ---- two workers (scripts/test runs pytest-xdist; docs/testing.md, "Workers") ------------------------------------
# A group runs in one worker, its tests in collection order: a module (its module fixtures start once), or the
# modules that share something bigger than a module (SHARED_GROUPS). The groups that take longest go first, so
# that no worker is left with one of them at the end while the other idles. xdist's own `loadgroup` reads marks
# into the test ids, which pytest 9.2 no longer honours: the groups are made here, from each test's module, by
# the scheduler below.
SHARED_GROUPS = {
    "kmsg": ("tests/daemon/test_agent_remote_write.py", "tests/daemon/test_daemon_kmsg.py",
             "tests/daemon/test_test_lines.py"),  # they write marked lines into the one kernel log and count them
    "vllm-shared": ("tests/guard/test_vllm_guard.py", "tests/hook/test_forecast_vllm.py",
                    "tests/hook/test_vllm_real.py", "tests/run/test_vllm_run.py"),  # tests/support/vllm_shared.py
    "live-stack": ("tests/dashboards/test_live_alertmanager.py", "tests/dashboards/test_live_prometheus.py",
                   "tests/dashboards/test_live_prometheus_collapse.py"),  # tests/dashboards/conftest.py's stack
}
LONGEST_FIRST = ("tests/ab/test_vllm_ladder.py", "live-stack", "vllm-shared", "tests/alerts/test_score.py",
                 "tests/ab/test_lab_ladder.py", "tests/daemon/test_flight_daemon.py", "kmsg",
                 "tests/ray/test_router.py", "tests/demo/test_demo.py", "tests/dashboards/test_prometheus_rules.py",
                 "tests/litellm/test_proxy.py")
_SHARED_VLLM = {"vllm_servers", "vllm_counting", "vllm_indexer", "vllm_under_run"}  # the fixtures of vllm-shared
_GROUP_OF_MODULE = {module: group for group, modules in SHARED_GROUPS.items() for module in modules}


def worker_group(nodeid: str) -> str:
    """The group a test runs in: its module's shared group, or its module."""
    module = nodeid.split("::", 1)[0]
    return _GROUP_OF_MODULE.get(module, module)


def _longest_first(items: list[pytest.Item]) -> None:
    rank = {group: index for index, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(worker_group(item.nodeid), len(rank)))  # stable: collection order within


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: pytest refuses an unknown hook where xdist is absent
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """With `--dist loadscope`, schedule by worker_group instead of by module alone."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.support.kmsg import SKIP_REASON, opted_in

    _longest_first(items)
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
def tiny_model() -> Path:
    """A random-weight 2-layer, hidden-128 Llama with a WordLevel tokenizer, made once per machine at a fixed path
    (tests/support/vllm.py: vLLM's compile cache is keyed by the model's path)."""
    from tests.support.vllm import cached_tiny_llama

    return cached_tiny_llama()


# ---- real vLLM servers shared by the session (tests/support/vllm_shared.py) ------------------------------------


@pytest.fixture(scope="session")
def vllm_servers(request: pytest.FixtureRequest, tiny_model: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServers]:
    """The session's shared vLLM launches; stopped, process groups and all, when the session ends."""
    from tests.support.vllm_shared import close_session, open_session

    servers = open_session(request.session.items, tmp_path_factory.mktemp("vllm-shared"), tiny_model)
    yield servers
    close_session(servers)


@pytest.fixture(scope="session")
def vllm_counting(vllm_servers: SharedServers) -> SharedVllm:
    """vLLM's default start with the plugin counting the CPU attention target (tests/support/vllm_shared.py)."""
    return vllm_servers.get("vllm_counting")


@pytest.fixture(scope="session")
def vllm_indexer(vllm_servers: SharedServers) -> SharedVllm:
    """vLLM with the plugin hooking only targets a Llama never runs, and the live forecast on."""
    return vllm_servers.get("vllm_indexer")


@pytest.fixture(scope="session")
def vllm_under_run(vllm_servers: SharedServers) -> SharedVllm:
    """vLLM under `memtel run`, vLLM's plugins off."""
    return vllm_servers.get("vllm_under_run")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """After a test's teardown, stop the shared vLLM launches it was the last user of."""
    try:
        return (yield)
    finally:
        shared = sys.modules.get("tests.support.vllm_shared")
        if shared is not None:
            shared.teardown_done(item.nodeid)
