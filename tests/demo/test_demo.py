"""`memtel demo` end to end: daemon, two served lab arms with the hook on every rank, the ladder, the report.

Small shapes so it runs in seconds: 4,096-token chunks, 3 layers, a 64 MiB budget and max-model-len
32,768 (fixed width 8,192), prompts of 8,192, 8,192 and 16,384 tokens. At this size the stock arm's
logits (16, 32, 48, 64 MiB) each need a new segment, as the full-size demo's do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.support.extras import need

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "8192,8192,16384", "--chunk", "4096", "--layers", "3", "--max-model-len", "32768",
         "--budget-mb", "64", "--time-scale", "0.01"]
MIB = 1 << 20
CALLS = {"stock": 1 + 3 * (2 + 2 + 4) * 1, "fixed": 1 + 3 * (2 + 2 + 4) * 2}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _demo(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "telemetry", "demo", "--out", str(out), *args], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def _child_sigint_default() -> None:
    """In the child: Ctrl-C's default, whatever this test process inherited. A suite started in the
    background by a shell (`pytest ... &`) runs with SIGINT ignored, and a child would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_replay(tokens: int, allocator: str = "sim") -> subprocess.Popen:
    """`memtel replay` for the small demo's shapes, started (read it with _replay_result)."""
    return subprocess.Popen([sys.executable, "-m", "telemetry", "replay", "--allocator", allocator, "--json",
                             "--tokens", str(tokens), "--chunk", "4096", "--layers", "3", "--max-model-len", "32768",
                             "--budget-mb", "64"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)


def _replay_result(process: subprocess.Popen) -> dict:
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    return json.loads(stdout)["arms"]


def _replay(tokens: int, allocator: str = "sim") -> dict:
    return _replay_result(_start_replay(tokens, allocator))


def _leftovers(out: Path) -> list[str]:
    """Processes of this demo still alive: anything naming its run directory or its ports."""
    ladder = yaml.safe_load((out / "ladder.yaml").read_text())
    ports = {a["serve"]["command"][a["serve"]["command"].index("--listen") + 1].rsplit(":", 1)[1]
             for a in ladder["arms"]}
    ports |= {url.rsplit(":", 1)[1].split("/")[0] for a in ladder["arms"] for url in a["ranks"].values()}
    ports |= {url.rsplit(":", 1)[1].split("/")[0] for url in ladder["nodes"].values()}
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = " ".join(process.info["cmdline"] or [])
        if str(out) in cmdline or ("telemetry" in cmdline and any(f" {p}" in cmdline for p in ports)):
            found.append(f"{process.info['pid']}: {cmdline}")
        else:
            try:
                listening = [c for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN
                             and str(c.laddr.port) in ports]
            except (psutil.AccessDenied, psutil.NoSuchProcess):
                listening = []
            if listening:
                found.append(f"{process.info['pid']} listens on {listening[0].laddr.port}: {cmdline}")
    return found


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _scrapes_after(out: Path) -> dict:
    """(arm, step) -> rank scrapes after the request, from results.jsonl."""
    scrapes = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "scrape" and record["phase"] == "after":
            scrapes[(record["arm"], record["step"])] = record["ranks"]
    return scrapes


@pytest.mark.slow
def test_demo_runs_the_whole_pipeline_and_agrees_with_replay(tmp_path):
    out = tmp_path / "run"
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    # `memtel replay` for the same shapes, run as its own command while the demo runs (read below).
    replaying = {tokens: _start_replay(tokens) for tokens in (8192, 16384)}
    try:
        result = _demo(out, "--allocator", "sim", "--scale", "1", *SMALL)
    finally:
        replays = {tokens: _replay_result(process) for tokens, process in replaying.items()}  # each has both arms
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"Report: {out / 'report.md'}" in result.stdout
    report = (out / "report.md").read_text()
    headings = [line for line in report.splitlines() if line.startswith("#")]
    assert headings[:2] == ["# A/B report: stock, fixed", "## About this run (memtel demo)"]
    for heading in ("### The ranks against the prediction", "### Where the growth happened, chunk step by chunk step",
                    "### Time to first token", "## 1. Allocator growth per rank", "## 2. Host MemAvailable per request",
                    "## 3. Time to first token per request"):
        assert heading in headings
    # The TTFT difference between the arms on this machine is not presented as the fix's effect.
    assert "**a TTFT difference between the arms in this run is not the fix's effect**" in report
    ttft = report.split("## 3. Time to first token per request")[1].split("\n## ")[0]
    assert "the difference between the arms is not the fix's effect" in ttft
    assert "cudaMalloc" not in " ".join(line for line in report.splitlines() if line.startswith("| arm"))
    assert "3 steps × 1 repeat(s)" in report and "status **complete**" in report
    plots = list((out / "plots").glob("*.png"))
    assert len(plots) >= 3 and all(p.stat().st_size > 1000 for p in plots)
    summary = json.loads((out / "summary.json").read_text())
    assert summary
    notes = json.loads((out / "demo-summary.json").read_text())
    assert notes["prediction_agrees"] is True

    # The ranks' numbers against `memtel replay` for the same shapes, run as its own command.
    scrapes = _scrapes_after(out)
    for arm in ("stock", "fixed"):
        replay_one = replays[8192][arm]
        replay_two = replays[16384][arm]
        for rank in ("rank0", "rank1"):
            first, second, third = (scrapes[(arm, step)][rank]
                                    for step in ("step1-8192", "step2-8192", "step3-16384"))
            assert first["reserved_bytes"] == replay_one["reserved_growth_bytes"], (arm, rank)
            assert first["num_device_alloc"] == replay_one["num_device_alloc"], (arm, rank)
            assert second["reserved_bytes"] == first["reserved_bytes"]  # same shapes again: all reused
            assert third["reserved_bytes"] == replay_two["reserved_growth_bytes"], (arm, rank)
            assert third["num_device_alloc"] == replay_two["num_device_alloc"], (arm, rank)
            # One empty warm-up launch, then chunk steps (2, 2, 4) x 3 layers x launches per step
            # (stock: 1, its largest logits are exactly the budget; fixed: 2 of 2,048 rows x 8,192).
            assert third["hook_calls_total"] == CALLS[arm]
    # Stock grows at every chunk step of its first request; fixed only at its first chunk.
    steps = {s["label"]: s for s in notes["arms"]["stock"]["steps"]}
    assert all(g > 0 for g in steps["step1-8192"]["measured_chunk_step_growth_bytes_first_rank"])
    assert [g > 0 for g in steps["step3-16384"]["measured_chunk_step_growth_bytes_first_rank"]] == [
        False, False, True, True]
    fixed = {s["label"]: s for s in notes["arms"]["fixed"]["steps"]}
    assert [g > 0 for g in fixed["step1-8192"]["measured_chunk_step_growth_bytes_first_rank"]] == [True, False]
    assert not any(fixed["step3-16384"]["measured_chunk_step_growth_bytes_first_rank"])
    assert all(s["modeled_prefill_s"] > 0 for s in notes["arms"]["fixed"]["steps"])

    # The hook wrote one per-call log per rank process, one line per hooked call.
    logs = sorted((out / "hook-logs").glob("*/memtel-calls-rank*-pid*.jsonl"))
    assert len(logs) == 4
    for log in logs:
        lines = log.read_text().splitlines()
        arm = log.parent.name.split("-")[0]
        assert len(lines) == CALLS[arm]

    # Nothing left behind: no child of this test, nothing naming the run or its ports.
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children_before
    assert _leftovers(out) == []

    # docs/demo.md: the commands at the top of ladder.yaml run the same comparison again.
    again = tmp_path / "again"
    rerun = [line[4:].strip() for line in (out / "ladder.yaml").read_text().splitlines() if line.startswith("#   ")]
    assert rerun[1:] == [f"memtel ab run {out / 'ladder.yaml'} --out OTHER", "kill %1"]
    daemon_argv = rerun[0].removesuffix(" &").split()
    assert daemon_argv[:2] == ["memtel", "daemon"]
    daemon = subprocess.Popen([sys.executable, "-m", "telemetry", *daemon_argv[1:]], cwd=ROOT, env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        (node_url,) = yaml.safe_load((out / "ladder.yaml").read_text())["nodes"].values()
        deadline = time.monotonic() + 30
        while not _answers(node_url):  # the daemon answers within a few seconds
            assert daemon.poll() is None and time.monotonic() < deadline, "the daemon of ladder.yaml's comment"
            time.sleep(0.1)
        argv = rerun[1].replace("OTHER", str(again)).split()
        done = subprocess.run([sys.executable, "-m", "telemetry", *argv[1:]], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=240)
    finally:
        daemon.terminate()
        daemon.wait(20)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "status **complete**" in (again / "report.md").read_text()


def test_demo_scale_shrinks_bytes_and_keeps_the_shape():
    from harness.ab.config import Step
    from harness.demo.notes import predict
    from harness.demo.setup import DemoSetup

    steps = [Step("a", 100_000, 1)]

    def grew(prediction):
        return [g > 0 for g in prediction.chunk_step_growth_bytes]

    full = predict(DemoSetup(allocator="sim", scale=1.0, time_scale=0), steps, "stock")[0]
    small = predict(DemoSetup(allocator="sim", scale=0.25, time_scale=0), steps, "stock")[0]
    # About a quarter of the bytes (the allocator's rounding is not scaled, so not exactly).
    assert 0.2 < small.reserved_after_bytes / full.reserved_after_bytes < 0.35
    # Full size: +4,608 MiB in 13 chunk steps, growing at each of the first 8 (until the 512 MiB budget).
    assert full.reserved_after_bytes == 4608 * MIB and len(full.chunk_step_growth_bytes) == 13
    assert grew(full)[:8] == [True] * 8 and not any(grew(full)[9:])
    assert grew(small)[:8] == [True] * 8 and not any(grew(small)[10:])
    for scale in (1.0, 0.25):
        fixed = predict(DemoSetup(allocator="sim", scale=scale, time_scale=0), steps, "fixed")[0]
        assert grew(fixed) == [True] + [False] * 12


def test_ctrl_c_stops_everything(tmp_path):
    out = tmp_path / "interrupted"
    process = subprocess.Popen([sys.executable, "-m", "telemetry", "demo", "--out", str(out), "--allocator", "sim",
                                "--steps", "100000,100000,200000", "--time-scale", "0.2", "--layers", "8"],
                               cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=_child_sigint_default)
    try:
        deadline = time.monotonic() + 90
        results = out / "results.jsonl"
        while time.monotonic() < deadline:  # the node sampled during the first request: a prefill is running
            text = results.read_text() if results.exists() else ""
            if '"event": "node_sample"' in text:
                break
            assert process.poll() is None, process.communicate()
            time.sleep(0.1)
        assert '"event": "request"' not in text, "the first request ended before the interrupt"
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert "interrupted" in stderr
    deadline = time.monotonic() + 2  # a process that has just exited may still be listed for a moment
    while _leftovers(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers(out) == []


FRACTIONAL_BUDGETS = ("0.5", "3.3")


@pytest.fixture(scope="module")
def fractional_demos(tmp_path_factory):
    """One small demo per fractional budget, all started at once (independent runs: their own ports and
    directories; one demo keeps about one core busy): budget -> (process, run directory)."""
    runs = {}
    try:
        for budget_mb in FRACTIONAL_BUDGETS:
            top = tmp_path_factory.mktemp(f"budget-{budget_mb}")
            with open(top / "stdout", "wb") as stdout, open(top / "stderr", "wb") as stderr:  # files: never blocks
                runs[budget_mb] = (subprocess.Popen(
                    [sys.executable, "-m", "telemetry", "demo", "--out", str(top / "run"), "--allocator", "sim",
                     "--steps", "4096,6144", "--chunk", "2048", "--layers", "2", "--max-model-len", "16384",
                     "--budget-mb", budget_mb, "--time-scale", "0", "--scale", "0.5"], cwd=ROOT, env=_env(),
                    stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL), top)
        yield runs
    finally:
        for process, _ in runs.values():
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.mark.parametrize("budget_mb", FRACTIONAL_BUDGETS)
@pytest.mark.slow
def test_demo_agrees_with_itself_at_a_fractional_budget(fractional_demos, budget_mb):
    """`--budget-mb 96.5` once gave a prediction that disagreed with the servers, and 0.5 crashed it."""
    process, top = fractional_demos[budget_mb]
    process.wait(timeout=240)
    out = top / "run"
    assert process.returncode == 0, (top / "stdout").read_text()[-3000:] + (top / "stderr").read_text()[-3000:]
    notes = json.loads((out / "demo-summary.json").read_text())
    assert notes["prediction_agrees"] is True
    assert notes["setup"]["logits_budget_bytes"] == int(float(budget_mb) * MIB)
    assert all(check["agree"] for arm in notes["arms"].values() for check in arm["steps"])


@pytest.mark.parametrize("args, expected", [
    (["--steps", "10,20"], "expected token counts of at least 64"),
    (["--steps", "100000,300000"], "steps of [300000] tokens do not fit --max-model-len 204800"),
    (["--scale", "0"], "expected a number in (0, 1], got 0.0"),
    (["--allocator", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_demo_arguments_fail_before_anything_starts(tmp_path, capsys, args, expected):
    """Through the CLI's entry function in this process (argparse's errors exit 2 by SystemExit, the demo's own
    by the code main returns); the command as a process exits with the same code (the first case)."""
    from telemetry.cli import main

    try:
        code = main(["demo", "--out", str(tmp_path / "bad"), *args])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    if args == ["--steps", "10,20"]:
        result = _demo(tmp_path / "bad", *args, timeout=60)
        assert result.returncode == 2 and expected in result.stderr
        assert not (tmp_path / "bad").exists()


@pytest.mark.gpu
def test_demo_on_cuda_uses_real_allocations(tmp_path):
    for module in ("httpx", "rich", "matplotlib", "numpy"):  # the demo is the harness extra's
        need(module)
    out = tmp_path / "cuda"
    result = _demo(out, "--allocator", "cuda", *SMALL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "**Allocator: real CUDA.**" in report
    assert "**Host memory does not move with device allocations on a discrete GPU:**" in report
    notes = json.loads((out / "demo-summary.json").read_text())
    assert notes["setup"]["allocator"] == "cuda" and notes["setup"]["scale"] == 1.0
    # The simulator is exact: real CUDA ranks match `memtel replay`'s prediction.
    assert notes["prediction_agrees"] is True, json.dumps(notes["arms"], indent=1)[:3000]
    scrapes = _scrapes_after(out)
    replay = _replay(16384, "sim")
    for arm in ("stock", "fixed"):
        assert scrapes[(arm, "step3-16384")]["rank0"]["reserved_bytes"] == replay[arm]["reserved_growth_bytes"]
    assert _leftovers(out) == []
