"""harness/ab/schedule.py: the order of blocks, resume, and what follows a failed step, with fake actions.

No server and no client: `FakeActions` records what the schedule asked for and answers as told.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.ab.client import RequestResult
from harness.ab.config import Arm, Ladder, ServeSpec, Step
from harness.ab.records import BlockSuperseded, RequestDone, Scrape, ServeStart, StepSkipped
from harness.ab.schedule import Resume, run_block, schedule

SERVE = ServeSpec(command=("serve",), health_url="http://127.0.0.1:9/health")
STEPS = (Step("s1", 1000, 1), Step("s2", 1000, 2), Step("s3", 1000, 3))


def ladder(*, served: bool = True, on_error: str = "stop-arm", order: str = "ABAB", repeats: int = 1) -> Ladder:
    serve = SERVE if served else None
    arms = (Arm("a", "http://127.0.0.1:9", serve=serve), Arm("b", "http://127.0.0.1:9", serve=serve))
    return Ladder(model="m", arms=arms, steps=STEPS, repeats=repeats, order=order, on_error=on_error)


@dataclass
class FakeActions:
    """Answers the schedule: `fail` lists steps whose request fails, `dies` those after which the server is dead,
    `no_start` how many bring-ups fail (from the first)."""

    fail: set[str] = field(default_factory=set)
    dies: set[str] = field(default_factory=set)
    no_start: int = 0
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    alive: bool = True

    def write(self, record: Any) -> None:
        self.calls.append(("write", type(record).__name__))

    def log(self, message: str) -> None:
        self.calls.append(("log", message))

    def block_started(self, arm: Arm, repeat: int) -> None:
        self.calls.append(("block", arm.name, repeat))

    def bring_up(self, arm: Arm, repeat: int, ranks: dict[str, Any], todo: list[Step]) -> bool:
        self.calls.append(("bring_up", [s.label for s in todo]))
        self.alive = True
        if self.no_start:
            self.no_start -= 1
            return False
        return True

    def run_step(self, arm: Arm, repeat: int, step: Step, ranks: dict[str, Any]) -> RequestResult:
        self.calls.append(("step", arm.name, repeat, step.label))
        if step.label in self.dies:
            self.alive = False
        ok = step.label not in self.fail
        return RequestResult(ok=ok, error=None if ok else "boom")

    def server_alive(self, arm: Arm) -> bool:
        return self.alive

    def stop_server(self) -> None:
        self.calls.append(("stop_server",))

    def stop_arm(self, arm: Arm, repeat: int, rest: list[Step], reason: str) -> None:
        self.calls.append(("stop_arm", [s.label for s in rest], reason))

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]


def test_abab_interleaves_arms_per_repeat_and_aabb_runs_an_arms_repeats_together():
    assert [(a.name, r) for a, r in schedule(ladder(repeats=2))] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert [(a.name, r) for a, r in schedule(ladder(repeats=2, order="AABB"))] == [("a", 0), ("a", 1), ("b", 0),
                                                                                   ("b", 1)]


def test_a_block_runs_its_steps_in_order_and_always_stops_its_server():
    the_ladder, actions, resume = ladder(), FakeActions(), Resume()
    run_block(actions, the_ladder, resume, the_ladder.arms[0], 0)
    assert [c[3] for c in actions.of("step")] == ["s1", "s2", "s3"]
    assert actions.calls[-1] == ("stop_server",) and actions.of("bring_up") == [("bring_up", ["s1", "s2", "s3"])]
    assert resume.done == {("a", 0, "s1"), ("a", 0, "s2"), ("a", 0, "s3")}


def test_a_failed_request_stops_the_arm_and_skips_the_rest_by_default():
    the_ladder, actions = ladder(), FakeActions(fail={"s2"})
    run_block(actions, the_ladder, Resume(), the_ladder.arms[0], 0)
    assert [c[3] for c in actions.of("step")] == ["s1", "s2"]
    assert actions.of("stop_arm") == [("stop_arm", ["s3"], "request failed at step s2: boom")]


def test_with_continue_a_failed_request_on_a_live_server_goes_on_to_the_next_step():
    the_ladder, actions = ladder(on_error="continue"), FakeActions(fail={"s1", "s2"})
    run_block(actions, the_ladder, Resume(), the_ladder.arms[0], 0)
    assert [c[3] for c in actions.of("step")] == ["s1", "s2", "s3"] and not actions.of("stop_arm")


def test_with_continue_a_served_arm_whose_server_died_gets_a_fresh_serve_for_the_rest():
    the_ladder, actions = ladder(on_error="continue"), FakeActions(fail={"s1"}, dies={"s1"})
    run_block(actions, the_ladder, Resume(), the_ladder.arms[0], 0)
    assert actions.of("bring_up") == [("bring_up", ["s1", "s2", "s3"]), ("bring_up", ["s2", "s3"])]
    assert [c[3] for c in actions.of("step")] == ["s1", "s2", "s3"]
    assert ("log", "[a repeat 0] server died; starting a fresh one for the rest") in actions.calls


def test_with_continue_a_fresh_serve_that_fails_ends_the_block():
    the_ladder, actions = ladder(on_error="continue"), FakeActions(fail={"s1"}, dies={"s1"})
    actions.no_start = 0
    original = actions.bring_up
    starts = iter([True, False])

    def bring_up(arm: Arm, repeat: int, ranks: dict[str, Any], todo: list[Step]) -> bool:
        original(arm, repeat, ranks, todo)
        return next(starts)

    actions.bring_up = bring_up  # type: ignore[method-assign]
    run_block(actions, the_ladder, Resume(), the_ladder.arms[0], 0)
    assert [c[3] for c in actions.of("step")] == ["s1"] and actions.calls[-1] == ("stop_server",)


def test_an_external_server_that_died_stops_the_arm_even_with_continue():
    the_ladder, actions = ladder(served=False, on_error="continue"), FakeActions(fail={"s1"}, dies={"s1"})
    run_block(actions, the_ladder, Resume(), the_ladder.arms[0], 0)
    assert actions.of("stop_arm") == [("stop_arm", ["s2", "s3"], "server died at step s1: boom")]


def test_the_last_step_failing_with_continue_stops_the_arm_with_nothing_left_to_skip():
    the_ladder, actions = ladder(on_error="continue"), FakeActions(fail={"s3"})
    run_block(actions, the_ladder, Resume(), the_ladder.arms[0], 0)
    assert actions.of("stop_arm") == [("stop_arm", [], "request failed at step s3: boom")]


def test_a_block_that_could_not_start_runs_no_step():
    the_ladder, actions = ladder(), FakeActions(no_start=1)
    run_block(actions, the_ladder, Resume(), the_ladder.arms[0], 0)
    assert not actions.of("step") and actions.calls[-1] == ("stop_server",)


def _records_of_a_block_that_stopped_after(steps: list[str]) -> list[Any]:
    """Records of an earlier run in which arm a's block 0 began and finished `steps`."""
    records: list[Any] = [ServeStart(arm="a", repeat=0, command=["serve"], env={}, cwd=None, pid=1, pgid=1, log="x")]
    for label in steps:
        records.append(Scrape(phase="after", arm="a", repeat=0, step=label, nodes={}, ranks={}, server=None))
        records.append(RequestDone(arm="a", repeat=0, step=label, seed=1, target_tokens=1000, prompt_tokens=1000,
                                   prompt_sha256="x", ok=True, started_at=1.0, ended_at=2.0))
    return records


def test_resume_skips_a_finished_block_without_touching_a_server():
    the_ladder, actions = ladder(), FakeActions()
    resume = Resume.from_records(_records_of_a_block_that_stopped_after(["s1", "s2", "s3"]))
    run_block(actions, the_ladder, resume, the_ladder.arms[0], 0)
    assert actions.calls == []


def test_resume_runs_an_unfinished_block_again_from_its_first_step_and_supersedes_its_records():
    the_ladder, actions = ladder(), FakeActions()
    resume = Resume.from_records(_records_of_a_block_that_stopped_after(["s1"]))
    assert resume.started_blocks == {("a", 0)} and resume.done == {("a", 0, "s1")}
    run_block(actions, the_ladder, resume, the_ladder.arms[0], 0)
    assert actions.calls[0] == ("write", "BlockSuperseded")
    assert "resumed: the block had not finished (1 of 3 steps done); it runs again from its first step on a " \
           "fresh server; the earlier records stay in results.jsonl, superseded" in actions.calls[1][1]
    assert [c[3] for c in actions.of("step")] == ["s1", "s2", "s3"]
    assert resume.started_blocks == set()


def test_supersede_names_an_external_server_as_not_restarted():
    the_ladder, resume = ladder(served=False), Resume(done={("a", 0, "s1")}, started_blocks={("a", 0)})
    record = resume.supersede(the_ladder, the_ladder.arms[0], 0, ["s1"])
    assert isinstance(record, BlockSuperseded) and record.steps == ["s1"]
    assert "on the same external server (http://127.0.0.1:9: not restarted, so not necessarily cold)" in record.reason
    assert resume.done == set()


def test_a_skipped_step_counts_as_finished_so_a_stopped_arm_is_not_run_again():
    resume = Resume.from_records([StepSkipped(arm="a", repeat=0, step=s.label, reason="x") for s in STEPS])
    the_ladder, actions = ladder(), FakeActions()
    assert resume.finished(the_ladder.arms[0], 0, list(STEPS)) == ["s1", "s2", "s3"]
    run_block(actions, the_ladder, resume, the_ladder.arms[0], 0)
    assert actions.calls == []
