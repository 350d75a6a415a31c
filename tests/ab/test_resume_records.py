"""Which records count after `--resume`: a block's records before its last `block_superseded` record are left out
(with the serve_stop of the server that attempt started), everything else stays; the report reads only those."""

from __future__ import annotations

import json

from harness.ab.records import (
    BlockSuperseded,
    PromptBuilt,
    RequestDone,
    RunEnd,
    ServeStart,
    ServeStop,
    StepSkipped,
    current_records,
    finished_steps,
)
from harness.ab.report import compute_metrics, load_run
from tests.ab.synthetic import Values, ladder, write_run


def request(arm: str, repeat: int, step: str, ttft: float = 1.0) -> RequestDone:
    return RequestDone(arm=arm, repeat=repeat, step=step, seed=1, target_tokens=10, prompt_tokens=10,
                       prompt_sha256="x", ok=True, started_at=1.0, ended_at=2.0, ttft_s=ttft)


def test_records_before_the_last_supersede_of_their_block_do_not_count():
    prompt = PromptBuilt(step="s1", repeat=0, seed=1, target_tokens=10, prompt_tokens=10, tokenize_calls=1,
                         build_s=0.1, sha256="x", path="p", needle="n", answer="1", question="q", filler_words=1,
                         pad_words=0, built_with="a")
    old_serve = ServeStart(arm="a", repeat=0, command=["x"], env={}, cwd=None, pid=11, pgid=11, log="l")
    old = [prompt, old_serve, request("a", 0, "s1", ttft=9.0), ServeStop(pgid=11, how="sigterm"),
           RunEnd(status="interrupted")]
    other = [request("b", 0, "s1"), StepSkipped(arm="b", repeat=0, step="s2", reason="r")]
    new_serve = ServeStart(arm="a", repeat=0, command=["x"], env={}, cwd=None, pid=22, pgid=22, log="l")
    resumed = [BlockSuperseded(arm="a", repeat=0, steps=["s1"], reason="resumed"), new_serve,
               request("a", 0, "s1", ttft=1.0), request("a", 0, "s2"), ServeStop(pgid=22, how="sigterm")]
    records = [*old, *other, *resumed]
    kept = current_records(records)
    assert prompt in kept and old[-1] in kept  # prompts and run-wide records always count
    assert old_serve not in kept and old[2] not in kept and old[3] not in kept  # the superseded attempt
    assert all(r in kept for r in other) and all(r in kept for r in resumed)
    assert finished_steps(records) == {("a", 0, "s1"), ("a", 0, "s2"), ("b", 0, "s1"), ("b", 0, "s2")}
    # Only the superseded block is affected; before the resume ran, its step counted as done.
    assert finished_steps([*old, *other]) == {("a", 0, "s1"), ("b", 0, "s1"), ("b", 0, "s2")}


def test_the_report_reads_only_the_attempt_that_counts(tmp_path):
    the_ladder = ladder(["a", "b"], ["s1", "s2"], repeats=1)
    write_run(tmp_path, {("a", 0, "s1"): Values(ttft_s=9.0, reserved_growth_mib=500),
                         ("b", 0, "s1"): Values(ttft_s=1.0), ("b", 0, "s2"): Values(ttft_s=1.0)}, the_ladder,
              status="interrupted")
    results = tmp_path / "results.jsonl"
    # The resumed attempt of block (a, 0): its own baseline and both steps, written after the supersede.
    resumed = tmp_path / "resumed"
    write_run(resumed, {("a", 0, "s1"): Values(ttft_s=2.0, reserved_growth_mib=100),
                        ("a", 0, "s2"): Values(ttft_s=3.0)}, the_ladder)
    later = [json.loads(line) for line in (resumed / "results.jsonl").read_text().splitlines()]
    offset = 10_000.0
    lines = [json.dumps(BlockSuperseded(ts=offset, arm="a", repeat=0, steps=["s1"], reason="resumed: test").to_json())]
    for record in later[1:]:  # not its run_start
        for key in ("ts", "started_at", "ended_at"):
            if key in record:
                record[key] += offset
        lines.append(json.dumps(record))
    with results.open("a") as f:
        f.write("\n".join(lines) + "\n")
    metrics = compute_metrics(load_run(tmp_path))
    assert metrics.requests[("a", 0, "s1")].ttft_client_s == 2.0
    assert metrics.requests[("a", 0, "s1")].ranks["rank0"].reserved_growth_bytes == 100 << 20
    assert metrics.run.status == "complete" and [s.steps for s in metrics.run.superseded] == [["s1"]]
    assert metrics.failures == []
