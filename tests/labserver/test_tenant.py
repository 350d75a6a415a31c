"""Another tenant of the lab node's memory (harness/labserver/tenant.py): `--tenant GIB@START_S+DURATION_S` and
`POST /lab/tenant`. Its bytes come out of the node, so a rank's launch and the hook's fit budget (the node's free
bytes) see them; it gives them back on time. In-process, no server: the whole-server story is `memtel demo --guard`'s
burst phases (tests/guard/test_guarded_demo.py)."""

from __future__ import annotations

import logging
import multiprocessing
import time

import pytest

from harness.labserver.node_memory import LabOutOfMemoryError, NodeLimitedBackend, NodeMemory
from harness.labserver.server import ApiError, LabService
from harness.labserver.tenant import Tenant, TenantPlan, parse_tenant
from telemetry.model.indexer.backends import SimBackend
from tests.support.cli import call_main

MIB = 1 << 20
GIB = 1 << 30


def node(capacity: int, ranks: int = 1) -> NodeMemory:
    return NodeMemory(capacity, ranks, multiprocessing.get_context("spawn"))


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.01)


def test_a_tenant_takes_what_the_ranks_leave_and_the_fit_budget_sees_it():
    memory = node(1000, ranks=2)
    memory.reserved[0] = 300
    assert memory.set_tenant(500) == 500
    assert (memory.used_bytes(), memory.free_bytes(), memory.tenant_bytes()) == (800, 200, 500)
    assert memory.set_tenant(900) == 700   # a new tenant replaces the last; the ranks' 300 are not its to take
    assert memory.free_bytes() == 0
    assert memory.set_tenant(0) == 0 and memory.free_bytes() == 700


def test_a_launch_that_fits_the_node_runs_out_while_the_tenant_holds_memory(caplog):
    memory = node(100 * MIB)
    backend = NodeLimitedBackend(SimBackend(), memory, rank=0)
    memory.set_tenant(90 * MIB)
    with caplog.at_level(logging.ERROR, logger="memtel.lab.worker"), pytest.raises(LabOutOfMemoryError):
        backend.alloc(40 * MIB)
    assert "NV_ERR_NO_MEMORY" in caplog.text and "0.09 GiB of it by another tenant" in caplog.text
    memory.set_tenant(0)
    backend.release(backend.alloc(40 * MIB))   # the tenant gone, the same allocation fits
    assert memory.reserved[0] >= 40 * MIB


def test_the_tenant_comes_and_goes_on_time_and_a_new_call_replaces_the_old_timer(caplog):
    tenant = Tenant(node(GIB))
    with caplog.at_level(logging.INFO, logger="memtel.lab.tenant"):
        tenant.schedule(TenantPlan(GIB // 2, start_s=0.05, duration_s=0.1))
        assert tenant.node.tenant_bytes() == 0
        wait_for(lambda: "gave back" in caplog.text)
    assert tenant.node.tenant_bytes() == 0
    assert [r.getMessage() for r in caplog.records] == [
        "lab node: another tenant holds 0.50 GiB of the node's 1.00 GiB for 0.1 s; 0.50 GiB left free",
        "lab node: the other tenant gave back 0.50 GiB; 1.00 GiB free"]
    assert tenant.hold(GIB // 4, seconds=0.1) == GIB // 4
    assert 0 <= tenant.describe()["tenant_leaves_in_s"] <= 0.1
    tenant.hold(GIB // 8)   # until the next call: the 0.1 s timer must not take these back
    time.sleep(0.2)
    assert tenant.describe() == {"tenant_bytes": GIB // 8, "tenant_leaves_in_s": None}
    tenant.stop()
    assert tenant.node.tenant_bytes() == GIB // 8   # stop cancels timers only; the node goes with the engine


def test_the_tenant_flag():
    assert parse_tenant("0.5@5+20") == TenantPlan(GIB // 2, 5.0, 20.0)
    assert parse_tenant("1@1e+3+2") == TenantPlan(GIB, 1000.0, 2.0)


@pytest.mark.parametrize(("args", "expected"), [
    (["--tenant", "0.5"], "expected GIB@START_S+DURATION_S"),
    (["--tenant", "nan@0+5"], "GIB"),
    (["--tenant", "0.5@-1+5"], "START_S"),
    (["--tenant", "0.5@0+0"], "DURATION_S"),
    (["--tenant", "0.5@0+1e9"], "DURATION_S"),
    (["--tenant", "0.5@0+5"], "needs --capacity-gb"),
    (["--capacity-gb", "0.25", "--tenant", "0.5@0+5"], "needs --capacity-gb of at least its 0.5 GiB"),
])
def test_a_bad_tenant_is_one_line_and_exit_2(args, expected):
    run = call_main(["lab", "serve", "--arm", "stock", "--allocator", "sim", "--port", "1", *args])
    assert run.returncode == 2, run
    assert expected in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) <= 2, run.stderr   # argparse: usage + the one error line


class _Engine:
    def __init__(self, tenant: Tenant | None) -> None:
        self.tenant = tenant


def test_post_lab_tenant_takes_and_gives_back_and_refuses_a_bad_body_with_a_400():
    service = LabService(_Engine(Tenant(node(GIB))), "lab", 1000)   # type: ignore[arg-type]
    answer = service.tenant({"gib": 0.75, "seconds": 60})
    assert answer["tenant_bytes"] == answer["asked_bytes"] == 3 * GIB // 4 and answer["node_free_bytes"] == GIB // 4
    assert 59 < answer["tenant_leaves_in_s"] <= 60
    assert service.tenant({"gib": 0})["tenant_bytes"] == 0
    for body in ({"gib": -1}, {"gib": "1"}, {"gib": True}, {"gib": 10**400}, {"gib": 1, "seconds": 0},
                 {"gib": 1, "seconds": float("inf")}, {"gib": 1, "then": 2}, [1]):
        with pytest.raises(ApiError) as refused:
            service.tenant(body)
        assert refused.value.status == 400 and "\n" not in refused.value.message, body
    unlimited = LabService(_Engine(None), "lab", 1000)   # type: ignore[arg-type]
    with pytest.raises(ApiError, match="--capacity-gb"):
        unlimited.tenant({"gib": 1})
