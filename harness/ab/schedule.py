"""The order of a run: which (arm, repeat) blocks run, in which order, what `--resume` skips or runs
again, and what happens after a step fails.

A block (a fresh serve, then the ladder's steps in order) is the unit of an A/B: a step's numbers
depend on what the same server did before it (a warm allocator reuses its segments). So a resumed run
skips finished blocks and runs an unfinished one again from its first step on a fresh server; its
earlier records stay in results.jsonl, marked by a `block_superseded` record, and no longer count.

This module is pure: the run's side effects (servers, requests, records) are behind `BlockActions`,
which harness/ab/runner.py implements and the unit tests fake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from harness.ab.client import RequestResult
from harness.ab.config import Arm, Ladder, Step
from harness.ab.records import RESULTS_FILE, BlockSuperseded, Record, block_of, current_records, finished_steps


def schedule(ladder: Ladder) -> list[tuple[Arm, int]]:
    """(arm, repeat) blocks: ABAB interleaves arms within each repeat, AABB runs each arm's repeats together."""
    if ladder.order == "AABB":
        return [(arm, r) for arm in ladder.arms for r in range(ladder.repeats)]
    return [(arm, r) for r in range(ladder.repeats) for arm in ladder.arms]


@dataclass
class Resume:
    """What the records of an earlier run (none for a fresh one) say is done and what was begun."""

    done: set[tuple[str, int, str]] = field(default_factory=set)  # (arm, repeat, step) with a request_done
    started_blocks: set[tuple[str, int]] = field(default_factory=set)  # blocks with records that count

    @classmethod
    def from_records(cls, prior: list[Record]) -> Resume:
        return cls(done=finished_steps(prior),
                   started_blocks={b for r in current_records(prior) if (b := block_of(r)) is not None})

    def finished(self, arm: Arm, repeat: int, steps: list[Step]) -> list[str]:
        return [s.label for s in steps if (arm.name, repeat, s.label) in self.done]

    def mark_done(self, arm: Arm, repeat: int, step: Step) -> None:
        self.done.add((arm.name, repeat, step.label))

    def supersede(self, ladder: Ladder, arm: Arm, repeat: int, finished: list[str]) -> BlockSuperseded:
        """An unfinished block runs again from its first step: its earlier records stop counting."""
        fresh = "on a fresh server" if arm.serve is not None else \
            f"on the same external server ({arm.url}: not restarted, so not necessarily cold)"
        reason = (f"resumed: the block had not finished ({len(finished)} of {len(ladder.steps)} steps done); "
                  f"it runs again from its first step {fresh}")
        self.done -= {(arm.name, repeat, s.label) for s in ladder.steps}
        self.started_blocks.discard((arm.name, repeat))
        return BlockSuperseded(arm=arm.name, repeat=repeat, steps=finished, reason=reason)


class BlockActions(Protocol):
    """The side effects of one block, as the run does them (harness/ab/runner.py)."""

    def write(self, record: Record) -> None: ...
    def log(self, message: str) -> None: ...
    def block_started(self, arm: Arm, repeat: int) -> None: ...
    def bring_up(self, arm: Arm, repeat: int, ranks: dict[str, Any], todo: list[Step]) -> bool: ...
    def run_step(self, arm: Arm, repeat: int, step: Step, ranks: dict[str, Any]) -> RequestResult: ...
    def server_alive(self, arm: Arm) -> bool: ...
    def stop_server(self) -> None: ...
    def stop_arm(self, arm: Arm, repeat: int, rest: list[Step], reason: str) -> None: ...


def run_block(actions: BlockActions, ladder: Ladder, resume: Resume, arm: Arm, repeat: int) -> None:
    """One block: skipped when finished, superseded when begun; its steps in order; its server stopped.

    After a failed step: with on_error `continue` the next step runs (on a fresh serve when the served
    arm's server died); otherwise, or when an external server died, the arm stops for this block and its
    remaining steps are recorded as skipped.
    """
    steps = list(ladder.steps)
    finished = resume.finished(arm, repeat, steps)
    if len(finished) == len(steps):
        return
    if (arm.name, repeat) in resume.started_blocks:
        record = resume.supersede(ladder, arm, repeat, finished)
        actions.write(record)
        actions.log(f"[{arm.name} repeat {repeat}] {record.reason}; the earlier records stay in {RESULTS_FILE}, "
                    "superseded")
    todo = steps
    actions.block_started(arm, repeat)
    ranks = ladder.ranks_for(arm)
    try:
        if not actions.bring_up(arm, repeat, ranks, todo):
            return
        index = 0
        while index < len(todo):
            step = todo[index]
            result = actions.run_step(arm, repeat, step, ranks)
            resume.mark_done(arm, repeat, step)
            index += 1
            if result.ok:
                continue
            alive = actions.server_alive(arm)
            rest = todo[index:]
            if ladder.on_error_for(arm) == "continue" and rest:
                if alive:
                    continue
                if arm.serve is not None:  # a served arm gets a fresh serve and goes on
                    actions.log(f"[{arm.name} repeat {repeat}] server died; starting a fresh one for the rest")
                    actions.stop_server()
                    if actions.bring_up(arm, repeat, ranks, rest):
                        continue
                    return
            reason = ("server died" if not alive else "request failed") + f" at step {step.label}: {result.error}"
            actions.stop_arm(arm, repeat, rest, reason)
            return
    finally:
        actions.stop_server()


__all__ = ["BlockActions", "Resume", "run_block", "schedule"]
