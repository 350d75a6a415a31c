"""The guard live in front of a small lab node: `memtel lab serve --capacity-gb 1.5`, its hook, `memtel guard`.

The node (harness/demo/guarded.py's NODE_ARGS: one rank, stock width, 4 layers, a logits budget that never
splits a launch) takes 100k tokens but not 1M: the 1M-token prefill runs out of its memory and kills the
engine. The hook exports memtel_forecast_max_prefill_tokens (its live forecast on), the guard (a real
`memtel guard` process) reads it. Everything talks over loopback; every process is stopped.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from harness.demo.guarded import Process, guard_limit, post_completion, prompt_text, start_guard, start_node
from tests.support.ports import free_port_block

pytestmark = pytest.mark.slow

CAPACITY_GB = 1.5
VOLATILE = ("id", "created")


class Node:
    """A lab node on free ports, with a guard (or several) in front."""

    def __init__(self, tmp: Path) -> None:
        base = free_port_block(8)
        self.port, self.hook_port = base, base + 1
        self.free = [base + 2 + i for i in range(6)]
        self.tmp = tmp
        self.log = tmp / f"node-{base}.log"
        self.guards: list[Process] = []
        self._node: Process | None = None

    def start(self) -> Node:
        self._node = start_node(self.port, self.hook_port, CAPACITY_GB, self.log, time_scale=0.01)
        return self

    @property
    def node(self) -> Process:
        assert self._node is not None, "the node was not started"
        return self._node

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def guard(self, *extra: str) -> tuple[str, int]:
        """A `memtel guard` in front of this node: (its URL, its metrics port), once it sees the limit."""
        port, metrics = self.free.pop(), self.free.pop()
        process = start_guard(port, self.port, [f"http://127.0.0.1:{self.hook_port}"], metrics,
                              self.tmp / f"guard-{port}.log", *extra)
        self.guards.append(process)
        wait_until(lambda: guard_limit(metrics) is not None, 60, f"the guard on {port} to see a limit")
        return f"http://127.0.0.1:{port}", metrics

    def rank_process(self) -> psutil.Process:
        """The rank whose hook exporter listens on the hook port."""
        for child in psutil.Process(self.node.process.pid).children(recursive=True):
            listening = [c for c in child.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
            if any(c.laddr.port == self.hook_port for c in listening):
                return child
        raise AssertionError(f"no process of the node listens on {self.hook_port}")

    def metric(self, name: str) -> float:
        return scrape(f"{self.url}/metrics").get(name, 0.0)

    def healthy(self) -> bool:
        hook = f"http://127.0.0.1:{self.hook_port}/metrics"
        return get_status(self.url + "/health") == 200 and get_status(hook) == 200

    def out_of_memory_lines(self) -> list[str]:
        return [line for line in self.log.read_text(errors="replace").splitlines() if "NV_ERR_NO_MEMORY" in line]

    def guard_log(self, url: str) -> Path:
        """The log of the guard at `url` (from guard())."""
        return self.tmp / f"guard-{url.rsplit(':', 1)[1]}.log"

    def stop(self) -> None:
        for guard in self.guards:
            guard.stop()
        if self._node is not None:
            self._node.stop()


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.1)


def settled(metrics_port: int) -> None:
    """Wait for the guard's limit to leave the dip of a prefill that just ran: the hook's forecast of a moment
    when the prefill still held its memory (the 1.5 GiB node takes 401,244 tokens at rest)."""
    wait_until(lambda: (guard_limit(metrics_port) or 0) >= 100_000, 30, "the limit to settle after a prefill")


def get_status(url: str) -> int | None:
    host, _, rest = url.removeprefix("http://").partition("/")
    conn = http.client.HTTPConnection(host.split(":")[0], int(host.split(":")[1]), timeout=5)
    try:
        conn.request("GET", "/" + rest)
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        conn.close()


def scrape(url: str) -> dict[str, float]:
    host, _, rest = url.removeprefix("http://").partition("/")
    conn = http.client.HTTPConnection(host.split(":")[0], int(host.split(":")[1]), timeout=5)
    try:
        conn.request("GET", "/" + rest)
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    return values


def complete(url: str, tokens: int, seed: int) -> tuple[int, dict, float]:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "lab", "prompt": prompt_text(tokens, seed), "max_tokens": 4}).encode()
    started = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    return response.status, json.loads(data), time.perf_counter() - started


def reset_prefix_cache(node: Node) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=10)
    conn.request("POST", "/reset_prefix_cache", body=b"")
    assert conn.getresponse().status == 200
    conn.close()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A node with a guard in front, for every test that keeps it serving (the blind test, last, adds two more)."""
    node = Node(tmp_path_factory.mktemp("lab-guard"))
    try:
        node.start()
        url, metrics = node.guard()
        yield node, url, metrics
    finally:
        node.stop()


def test_a_32k_prompt_through_the_guard_gets_the_same_answer_as_going_direct(guarded):
    node, url, _ = guarded
    status, direct, _ = complete(node.url, 32_768, seed=1)
    reset_prefix_cache(node)  # or the second answer reports the first one's blocks as cached
    status_via, via, _ = complete(url, 32_768, seed=1)
    assert (status, status_via) == (200, 200)
    assert {k: v for k, v in via.items() if k not in VOLATILE} == {k: v for k, v in direct.items()
                                                                    if k not in VOLATILE}
    assert via["usage"]["prompt_tokens"] == 32_768


def test_a_1m_prompt_is_refused_in_milliseconds_and_the_node_keeps_serving(guarded):
    """Over what the node takes at best (its limit at rest): refused for good, 400 (telemetry/admission/at_best.py)."""
    node, url, metrics = guarded
    assert complete(url, 100_000, seed=2)[0] == 200
    prompt_tokens_before = node.metric("vllm:prompt_tokens_total")
    settled(metrics)
    limit = guard_limit(metrics)
    assert limit is not None and 100_000 <= limit < 1_048_576
    wait_until(lambda: "memtel_guard_limit_tokens_at_best" in scrape(f"http://127.0.0.1:{metrics}/metrics"), 30,
               "a reading of the rank taken between prefills (the at-best limit)")
    timings = []
    for seed in (3, 4, 5, 6, 7):
        outcome = post_completion(url, 1_048_576, seed)
        timings.append(outcome.seconds)
        assert outcome.status == 400 and outcome.error_type == "invalid_request_error", outcome
    fields = outcome.fields
    assert fields["prompt_tokens"] == 1_048_576 and fields["prompt_tokens_counted_by"] == "words"
    assert (fields["reason"], fields["retryable"]) == ("exceeds_memory_at_best", False)
    assert fields["limit_tokens"] == fields["max_prefill_tokens"] and 100_000 <= fields["limit_tokens"] < 1_048_576
    assert fields["limit_at_best_from"] == "memory" and fields["limit_tokens"] <= fields["limit_tokens_at_best"] \
        < 1_048_576
    assert (fields["rank"], fields["hook"]) == ("0", f"http://127.0.0.1:{node.hook_port}/metrics")
    assert (fields["at_best_rank"], fields["at_best_hook"]) == ("0", f"http://127.0.0.1:{node.hook_port}/metrics")
    assert fields["node"] and fields["max_model_len"] == 1_100_000
    # From the first byte sent to the 400 read back, the 4.2 MB prompt included: the median of five (a single try
    # can meet a busy moment on a shared 2-core machine; BENCHMARKS.md, "memtel guard", has the figures).
    assert sorted(timings)[len(timings) // 2] < 0.1, timings
    # The node never saw it, and serves the next request.
    assert node.metric("vllm:prompt_tokens_total") == prompt_tokens_before
    assert node.healthy() and node.out_of_memory_lines() == []
    assert complete(url, 32_768, seed=8)[0] == 200


def test_four_prompts_that_fit_alone_but_not_together_wait_their_turn_and_none_runs_out(guarded):
    """The default queue (--queue-s 30): those that do not fit beside the others wait for their holds to drain."""
    node, url, metrics = guarded
    settled(metrics)
    limit = guard_limit(metrics)
    assert limit is not None
    each = int(limit * 0.4)  # two fit beside each other, three do not; each prefill takes about a second
    results: list = [None] * 4
    before = scrape(f"http://127.0.0.1:{metrics}/metrics").get("memtel_guard_queue_outcomes_total", 0.0)

    def send(i: int) -> None:
        results[i] = complete(url, each, seed=10 + i)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert [r[0] for r in results] == [200] * 4, results
    after = scrape(f"http://127.0.0.1:{metrics}/metrics").get("memtel_guard_queue_outcomes_total", 0.0)
    assert after - before >= 1   # at least one waited in the queue (each outcome counted once)
    assert node.healthy() and node.out_of_memory_lines() == []
    wait_until(lambda: scrape(f"http://127.0.0.1:{metrics}/metrics").get("memtel_guard_in_prefill_tokens") == 0,
               10, "the holds to be released")


def test_without_the_guard_the_1m_prompt_kills_the_node(tmp_path):
    node = Node(tmp_path)
    try:
        node.start()
        assert complete(node.url, 100_000, seed=2)[0] == 200
        status, body, _ = complete(node.url, 1_048_576, seed=3)
        assert status == 500 and body["error"]["type"] == "InternalServerError"
        assert node.out_of_memory_lines(), "the rank logs the driver-like NV_ERR_NO_MEMORY line"
        # The next request: the dead engine answers 500 until the server has exited, then nothing answers.
        outcome = post_completion(node.url, 32_768, seed=4)
        assert outcome.status in (500, None), outcome
        wait_until(lambda: not node.node.alive(), 30, "the lab server to exit")
        assert post_completion(node.url, 32_768, seed=5).status is None
    finally:
        node.stop()


def test_blind_when_the_hook_stops_then_the_limit_again(guarded):
    node = guarded[0]  # the kept node, after the tests above; two more guards in front of it
    admit_url, admit_metrics = node.guard("--stale-s", "6")
    reject_url, reject_metrics = node.guard("--stale-s", "6", "--when-blind", "reject")
    rank = node.rank_process()
    logs = [node.guard_log(admit_url), node.guard_log(reject_url)]
    # A guard started beside a fresh node may have been blind until the first forecast: count from here.
    episodes = {m: scrape(f"http://127.0.0.1:{m}/metrics")["memtel_guard_blind_episodes_total"]
                for m in (admit_metrics, reject_metrics)}
    lines = {log: log.read_text().count("is blind") for log in logs}
    rank.send_signal(signal.SIGSTOP)  # the hook's exporter (in the rank) stops answering
    try:
        for metrics in (admit_metrics, reject_metrics):
            wait_until(lambda m=metrics: scrape(f"http://127.0.0.1:{m}/metrics").get("memtel_guard_blind") == 1,
                       30, "the guard to be blind")
        outcome = post_completion(reject_url, 32_768, seed=1, timeout_s=30)
        assert outcome.status == 503 and outcome.error_type == "memtel_guard_blind", outcome
        assert outcome.fields["hooks"] == [f"http://127.0.0.1:{node.hook_port}/metrics"]
        assert get_status(reject_url + "/health") == 503  # refusing everything: down for a load balancer
        # admit: forwarded unchecked (the stopped rank answers once it runs again)
        result: list = []
        thread = threading.Thread(target=lambda: result.append(post_completion(admit_url, 1_000, seed=2)))
        thread.start()
        wait_until(lambda: scrape(f"http://127.0.0.1:{admit_metrics}/metrics").get(
            "memtel_guard_blind_decisions_total", 0) >= 1, 30, "the admit guard to decide blind")
    finally:
        rank.send_signal(signal.SIGCONT)
    thread.join(120)
    assert result and result[0].status == 200, result
    for metrics in (admit_metrics, reject_metrics):
        settled(metrics)
        values = scrape(f"http://127.0.0.1:{metrics}/metrics")
        assert values["memtel_guard_blind"] == 0
        assert values["memtel_guard_blind_episodes_total"] == episodes[metrics] + 1
    assert get_status(reject_url + "/health") == 200
    for url, metrics in ((admit_url, admit_metrics), (reject_url, reject_metrics)):
        # The at-best limit is known again (the reading from before the hook stopped, taken between prefills).
        wait_until(lambda m=metrics: "memtel_guard_limit_tokens_at_best" in scrape(f"http://127.0.0.1:{m}/metrics"),
                   30, "the at-best limit")
        outcome = post_completion(url, 1_048_576, seed=3)
        assert outcome.status == 400 and outcome.fields["reason"] == "exceeds_memory_at_best", outcome
        assert post_completion(url, 1_000, seed=4).status == 200
    assert all(log.read_text().count("is blind") == lines[log] + 1 for log in logs)
