"""MemtelEngineStalled on a real server (issue 29): the lab server (`memtel lab serve`, simulator allocator, its
rank a separate process with memtel's hook) in a long prefill, its rank stopped with SIGSTOP while its API keeps
answering. What the rule reads must tell the two apart: during the prefill no token is counted but hooked calls
run; once stopped, /health still answers 200 and a request is still running, and nothing moves (the hook's
exporter, inside the stopped rank, does not answer: Prometheus sees its target down, no hooked call).

A live Prometheus (the shipped prometheus.yml, every job scraped and the rules evaluated every second, as
tests/dashboards/live.py runs it) scrapes the lab as the vllm and hook jobs and evaluates the shipped rule with
only its window and `for` shortened (WINDOW_S, FOR_S; the expression is the shipped one). The alert stays quiet
through the prefill although the rule's first condition (requests running for the whole window) holds, and goes
pending, then firing, once the rank is stopped. `memtel top`'s frames (its History, with the same window) read the
same lab beside it: "progressing", then STALLED."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from telemetry.catalogue.metrics import HOOK_CALLS
from telemetry.catalogue.vllm import GENERATION_TOKENS, NUM_REQUESTS_RUNNING, PROMPT_TOKENS
from telemetry.ledger.stall import StallWatch
from telemetry.ledger.top_cli import History, frame, take_frame
from tests.dashboards.live import prometheus_config, start_prometheus
from tests.support.ports import free_port, free_port_block

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]

RUNNING, PROMPT, GENERATED = NUM_REQUESTS_RUNNING.series, PROMPT_TOKENS.series, GENERATION_TOKENS.series
CALLS = HOOK_CALLS.series
RULES = Path(__file__).resolve().parents[2] / "telemetry" / "alerts" / "rules" / "memtel-alerts.yml"
ALERT, NODE = "MemtelEngineStalled", "lab-node"
WINDOW_S, FOR_S = 4, 2   # the shipped rule's 3m and 1m, shortened for a 1 s scrape and evaluation


def stalled_rule_file(directory: Path) -> Path:
    """The shipped MemtelEngineStalled alone, its window and `for` shortened; every other word as shipped."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    (rule,) = [dict(r) for g in groups for r in g["rules"] if r.get("alert") == ALERT]
    expr, windows = re.subn(r"\[3m\]|offset 3m", lambda m: m.group(0).replace("3m", f"{WINDOW_S}s"), rule["expr"])
    assert windows == 6 and rule["for"] == "1m", (windows, rule)
    rule.update(expr=expr, **{"for": f"{FOR_S}s"})
    path = directory / "stalled.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "memtel-engine", "rules": [rule]}]}, sort_keys=False))
    return path


def start_watching_prometheus(tmp: Path, port: int, hook: int, client: httpx.Client):
    config_dir = tmp / "prometheus"
    (config_dir / "targets").mkdir(parents=True)
    for job, target in (("vllm", port), ("hook", hook)):
        (config_dir / "targets" / f"{job}.yml").write_text(
            yaml.safe_dump([{"targets": [f"127.0.0.1:{target}"], "labels": {"node": NODE}}]))
    config = prometheus_config(config_dir, [stalled_rule_file(tmp)], alertmanager=None)
    return start_prometheus(tmp, config, client)


class TopFrames:
    """`memtel top`'s frames over the lab (its API's /metrics as the engine, its rank's hook), with its memory
    between frames and the test's window; no daemon answers (a refused port)."""

    def __init__(self, base: str, hook_url: str) -> None:
        self.args = argparse.Namespace(daemon=[f"http://127.0.0.1:{free_port()}/metrics"], hooks=[hook_url],
                                       engines=[base + "/metrics"], sort="rank", interval=1.0)
        self.history = History(stall=StallWatch(window_s=WINDOW_S))

    def engine_line(self) -> str:
        report, engines = take_frame(self.args, 1.0)
        deltas = self.history.update(report, engines)
        lines = frame(report, self.history, deltas, sort="rank", paused=False, width=200, height=200, interval=1)
        (line,) = [line for line in lines if line.startswith("  engine: ")]
        return line


def values(url: str, timeout: float = 2.0) -> dict[str, float]:
    """Each family's samples summed, by sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=timeout).text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
        except httpx.HTTPError:
            result = None
        if result:
            return result
        time.sleep(0.2)
    raise TimeoutError(what)


def test_a_stopped_rank_answers_health_pages_and_shows_in_top_while_a_long_prefill_does_neither(tmp_path):
    port = free_port_block(2)
    hook = port + 1
    base, hook_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{hook}/metrics"
    with open(tmp_path / "lab.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "telemetry", "lab", "serve", "--arm", "stock", "--port", str(port),
             "--host", "127.0.0.1", "--model-name", "lab", "--allocator", "sim", "--ranks", "1",
             "--max-model-len", "65536", "--chunk", "1024", "--layers", "2", "--budget-mb", "64", "--scale", "0.05",
             "--time-scale", "14", "--no-unified-memory", "--memtel-port", str(hook)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    rank = None
    client = httpx.Client(timeout=5.0)
    prometheus = None
    try:
        prometheus, api = start_watching_prometheus(tmp_path, port, hook, client)
        wait_for(lambda: httpx.get(base + "/health", timeout=1).status_code == 200, 120, "the lab server's /health")
        wait_for(lambda: any(t["health"] == "up" for t in api.targets() if t["labels"]["job"] == "memtel-vllm"), 30,
                 "Prometheus scraping the lab")
        top = TopFrames(base, hook_url)
        answer: dict[str, int] = {}

        def request() -> None:
            answer["status"] = httpx.post(base + "/v1/completions", timeout=300, json={
                "model": "lab", "prompt": "word " * 60000, "max_tokens": 4}).status_code

        requester = threading.Thread(target=request)
        requester.start()
        # The prefill runs: a request running, hooked calls counted, no prompt or generated token counted yet.
        wait_for(lambda: values(base + "/metrics")[RUNNING] == 1, 60, "the request running")
        first = wait_for(lambda: (v := values(hook_url)).get(CALLS, 0) > 0 and v, 60, "hooked calls in the rank")
        started = time.monotonic()
        # Long enough for the rule's first condition (requests running through the whole window) to hold for
        # longer than its `for`: quiet only because the hooked calls move. Top says so on every frame.
        while time.monotonic() < started + WINDOW_S + FOR_S + 2:
            assert top.engine_line() == "  engine: 1 request running, progressing"
            time.sleep(0.3)
        running_all_window = api.query(f'min_over_time({RUNNING}{{node="{NODE}"}}[{WINDOW_S}s]) > 0')
        assert running_all_window, "the rule's first condition held through the prefill"
        assert not [a for a in api.alerts_within(WINDOW_S + FOR_S + 2) if a["labels"]["alertname"] == ALERT]
        progress = values(hook_url)
        metrics = values(base + "/metrics")
        assert metrics[RUNNING] == 1 and metrics[PROMPT] == 0 and metrics[GENERATED] == 0, metrics
        assert progress[CALLS] > first[CALLS], "a long prefill makes hooked calls all along"

        (rank,) = [p for p in psutil.Process(server.pid).children(recursive=True)
                   if "multiprocessing.spawn" in " ".join(p.cmdline())]
        rank.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(1)
        stopped = values(base + "/metrics")
        seen: dict[str, float] = {}
        shown_stalled = None
        while "firing" not in seen or shown_stalled is None:
            assert time.monotonic() < stopped_at + WINDOW_S + FOR_S + 10, (seen, shown_stalled)
            assert httpx.get(base + "/health", timeout=2).status_code == 200  # the API keeps answering
            now = values(base + "/metrics")
            assert now[RUNNING] == 1 and now[PROMPT] == stopped[PROMPT] and now[GENERATED] == stopped[GENERATED]
            for alert in api.alerts(ALERT):
                assert alert["labels"]["node"] == NODE and alert["labels"]["severity"] == "critical"
                seen.setdefault(alert["state"], time.monotonic() - stopped_at)
            line = top.engine_line()
            if "STALLED" in line:
                shown_stalled = shown_stalled or line
        assert "pending" in seen and seen["pending"] <= seen["firing"], seen  # pending, then firing
        print(f"after SIGSTOP: {ALERT} pending at {seen['pending']:.1f} s, firing at {seen['firing']:.1f} s; "
              f"top: {shown_stalled.strip()}")
        assert re.fullmatch(r"  engine: STALLED for \d+s \(1 request running, no progress\)", shown_stalled)
        with pytest.raises(httpx.TimeoutException):  # the hook's exporter is in the stopped rank
            httpx.get(hook_url, timeout=1.0)

        rank.send_signal(signal.SIGCONT)
        requester.join(timeout=240)
        assert answer.get("status") == 200
        done = values(base + "/metrics")
        assert done[PROMPT] == 60000 and done[GENERATED] > 0 and values(hook_url)[CALLS] > progress[CALLS]
    except BaseException:
        print((tmp_path / "lab.log").read_text(errors="replace")[-3000:])
        if prometheus is not None:
            print(prometheus.log_tail())
        raise
    finally:
        if rank is not None and rank.is_running():
            rank.send_signal(signal.SIGCONT)
        if prometheus is not None:
            prometheus.stop()
        client.close()
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
