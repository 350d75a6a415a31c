"""`memtel guard`'s flags: bad ones are one line and exit 2, before anything listens."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.cli import main
from telemetry.guard import cli
from tests.guard.servers import StubHook, StubUpstream, exposition, make_proxy
from tests.support.cli import call_main
from tests.support.ports import free_port_block


@pytest.mark.parametrize(("args", "words"), [
    (["--upstream", "ftp://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://127.0.0.1:9200"], "--upstream"),
    (["--upstream", "http://h:1/api", "--listen", "127.0.0.1:0", "--hooks", "http://127.0.0.1:9200"], "base URL"),
    (["--upstream", "http://h:1", "--listen", "nohost", "--hooks", "http://127.0.0.1:9200"], "--listen"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1,,http://b:2"], "--hooks"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1,http://a:1"], "twice"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1", "--stale-s", "0"], "--stale-s"),
    # Under a second every forecast would be stale: the guard blind for good (issue 41).
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1", "--stale-s", "1e-9"],
     "--stale-s"),
    # On an address of no interface: were the flag taken, the command would fail at once instead of serving.
    (["--upstream", "http://h:1", "--listen", "192.0.2.1:9", "--hooks", "http://a:1", "--reserve-mb", "nan"],
     "--reserve-mb"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1", "--when-blind", "maybe"],
     "--when-blind"),
    (["--upstream", "http://h:1", "--listen", "127.0.0.1:0", "--hooks", "http://a:1", "--metrics-listen", "x"],
     "--metrics-listen"),
    (["--listen", "127.0.0.1:0", "--hooks", "http://a:1"], "--upstream"),
])
def test_bad_flags_are_one_line_and_exit_2(args, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        status = main(["guard", *args])
        raise SystemExit(status)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_core_install_is_enough():
    # The guard runs on serving boxes: no harness package, no httpx.
    code = ("import sys; import telemetry.guard.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('harness', 'httpx', 'torch', 'numpy')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_listen_address_in_use_is_one_line_and_exit_1(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status = main(["guard", "--upstream", "http://127.0.0.1:1", "--listen", f"127.0.0.1:{port}",
                       "--hooks", "http://127.0.0.1:2"])
    err = capsys.readouterr().err
    assert status == 1 and f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1


def test_the_command_serves_its_metrics_and_stops_cleanly_on_sigterm(tmp_path):
    import http.client
    import os
    import signal
    import time
    from pathlib import Path

    from tests.support.ports import free_port_block

    port = free_port_block(2)   # one block: two free_port() calls can return the same port
    metrics = port + 1
    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "guard.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "telemetry", "guard", "--upstream", "http://127.0.0.1:1",
                                    "--listen", f"127.0.0.1:{port}", "--hooks", "http://127.0.0.1:2",
                                    "--metrics-listen", f"127.0.0.1:{metrics}"], stdout=out, stderr=subprocess.STDOUT,
                                   cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        deadline, text = time.monotonic() + 30, ""
        while "memtel_guard_blind 1.0" not in text and time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", metrics, timeout=2)
                conn.request("GET", "/metrics")
                text = conn.getresponse().read().decode()
                conn.close()
            except OSError:
                time.sleep(0.1)
        assert "memtel_guard_blind 1.0" in text and "memtel_guard_hooks 1.0" in text  # the hook does not answer
        assert "memtel_guard_rejected_total{reason=\"would_not_fit\"} 0.0" in text
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "memtel guard stopped" in log.read_text()


GIB = 1 << 30


def samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def complete(port: int) -> tuple[int, str | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"model": "stub", "prompt": "one two three",
                                                              "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        answer = conn.getresponse()
        answer.read()
        return answer.status, answer.getheader("X-Upstream")
    finally:
        conn.close()


def test_the_command_serves_two_replicas_with_its_metrics_and_stops_on_sigterm(upstream, monkeypatch):
    sick = StubUpstream()
    sick.healthy = False   # its /health answers 503: the guard's health watch takes it out of the pool, until 200
    hooks = [StubHook(lambda: exposition(1000, budget=8 * GIB)),
             StubHook(lambda: exposition(1000, budget=8 * GIB, node="node-b"))]
    port = free_port_block(2)
    metrics = port + 1
    # The command's logging.basicConfig adds its handler only to a root logger without one (pytest's is removed
    # here; call_main puts the handlers back), so its log reaches its stderr.
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    seen: dict[str, object] = {}
    before = signal.getsignal(signal.SIGTERM)   # a test runner's own, or the default
    done = threading.Event()

    def client() -> None:
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline and not done.is_set():
                try:
                    now = samples(metrics)
                except OSError:
                    time.sleep(0.02)
                    continue
                limits = {dict(labels).get("replica"): value for (name, labels), value in now.items()
                          if name == "memtel_guard_replica_limit_tokens"}
                pool = {dict(labels).get("replica"): value for (name, labels), value in now.items()
                        if name == "memtel_guard_replica_in_pool"}
                if "pool" in seen:   # the sick engine answers again: back in the pool at the next health poll
                    if 0.0 not in pool.values():
                        seen["back"] = pool
                        break
                elif len(limits) == 2 and 0.0 in pool.values():
                    seen.update(limits=limits, pool=pool, blind=now[("memtel_guard_blind", ())],
                                hooks=now[("memtel_guard_hooks", ())], answer=complete(port), after=samples(metrics))
                    sick.healthy = True
                time.sleep(0.02)
        finally:
            if signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_DFL, signal.SIG_IGN, None):
                os.kill(os.getpid(), signal.SIGTERM)   # the command's own handler (asyncio's): its stop

    thread = threading.Thread(target=client)
    thread.start()
    try:
        run = call_main(["guard", "--replica", f"{upstream.url}={hooks[0].url}", "--replica",
                         f"{sick.url}={hooks[1].url}", "--listen", f"127.0.0.1:{port}", "--metrics-listen",
                         f"127.0.0.1:{metrics}", "--reserve-mb", "4096", "--stale-s", "1"])
    finally:
        done.set()
        thread.join(30)
        if before is not None:
            signal.signal(signal.SIGTERM, before)   # asyncio leaves the default behind
        sick.stop()
        for hook in hooks:
            hook.stop()
    assert run.returncode == 0, run.stderr
    assert seen, run.stderr
    healthy, ill = upstream.url, sick.url
    assert seen["limits"] == {healthy: 500, ill: 500}   # --reserve-mb 4096 of each 8 GiB budget: half the tokens
    assert seen["pool"] == {healthy: 1.0, ill: 0.0}
    assert (seen["blind"], seen["hooks"]) == (0.0, 2.0)
    assert seen["answer"] == (200, "stub")   # forwarded to the replica in the pool
    after = seen["after"]   # the metrics once it has forwarded one: its counters, histogram and gauges
    assert after[("memtel_guard_replica_forwarded_total", (("replica", healthy),))] == 1
    assert after[("memtel_guard_added_latency_seconds_bucket", (("le", "+Inf"),))] == 1
    assert after[("memtel_guard_passed_through_total", ())] == 0
    assert after[("memtel_guard_fresh_ranks", ())] == 2
    assert re.search(rf"^\S+ \S+ memtel\.guard INFO: memtel guard on http://127\.0\.0\.1:{port} in front of "
                     rf"{re.escape(healthy)}, {re.escape(ill)}, reading 2 hook\(s\); metrics http://127\.0\.0\.1:{metrics}/metrics$",
                     run.stderr, re.MULTILINE), run.stderr
    assert seen["back"] == {healthy: 1.0, ill: 1.0}
    assert re.search(rf"WARNING: memtel guard: replica {re.escape(ill)} leaves the pool: /health: .*\n(.*\n)*.*"
                     rf"WARNING: memtel guard: replica {re.escape(ill)} is healthy again: back in the pool$",
                     run.stderr, re.MULTILINE), run.stderr
    assert re.search(r"memtel guard stopped$", run.stderr, re.MULTILINE), run.stderr
    for closed in (port, metrics):   # both servers stopped with the command
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", closed)) != 0


def test_the_help_says_what_each_flag_takes_and_its_default():
    run = call_main(["guard", "--help"])
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    assert text.startswith("usage: memtel guard [-h] [--upstream URL] --listen HOST:PORT [--hooks URL[,URL...]] "
                           "[--replica URL=HOOK[,HOOK...]] [--replicas FILE.yaml] [--queue-s QUEUE_S] "
                           "[--max-queued MAX_QUEUED] [--reserve-mb RESERVE_MB] [--stale-s STALE_S] "
                           "[--when-blind {admit,reject}] [--metrics-listen HOST:PORT]")
    assert "`memtel guard`: an OpenAI-compatible reverse proxy that refuses the prompt the engine could not take." \
        in text  # the module's doc is the description
    for help_text in ("where clients connect, e.g. 0.0.0.0:8001",
                      "one engine of several and its ranks' hooks (repeat it; instead of --upstream/--hooks)",
                      "the replicas in a YAML file: replicas: [{upstream: URL, hooks: [URL, ...]}, ...]",
                      "before its 503 (default 30; 0: 503 at once)",
                      "while no hook is fresh (default admit)"):
        assert help_text in text, help_text


@pytest.mark.parametrize("flags, line", [
    (["--reserve-mb", "17000000"],
     "memtel guard: error: argument --reserve-mb: expected at most 16,777,216, got 17000000.0"),  # 16 TiB
    (["--reserve-mb", "nan"], "memtel guard: error: argument --reserve-mb: "),
    (["--metrics-listen", "x"], "memtel guard: error: --metrics-listen: 'x' is not HOST:PORT"),
])
def test_a_bad_flag_is_named_first_in_its_line(flags, line):
    # --listen on an address of no interface here: were the flag taken, the command would fail there at once
    # ("cannot listen") instead of serving until stopped.
    run = call_main(["guard", "--upstream", "http://h:1", "--listen", "192.0.2.1:9", "--hooks", "http://a:1", *flags])
    assert run.returncode == 2 and run.stderr.startswith(line) and run.stderr.count("\n") == 1, run.stderr


def test_the_command_scrapes_with_a_timeout_of_at_least_0_2_s_and_logs_metrics_not_served(monkeypatch, caplog):
    seen = []

    async def scrape(tracker, poll_s, timeout_s):
        seen.append((tracker, poll_s, timeout_s))
        signal.raise_signal(signal.SIGTERM)   # the command's own stop: asyncio's handler is installed by now
        await asyncio.Event().wait()

    monkeypatch.setattr(cli, "scrape_forever", scrape)
    caplog.set_level(logging.INFO, logger="memtel.guard")
    proxy = make_proxy()
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert asyncio.run(cli._serve(proxy, "127.0.0.1", 0, None, 0.1)) == 0
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)   # asyncio leaves the default behind
    assert seen == [(proxy.tracker, pytest.approx(0.1 / 3), 0.2)]   # stale_s / 2 is 0.05: the floor
    lines = [r.getMessage() for r in caplog.records if r.name == "memtel.guard"]
    assert re.fullmatch(r"memtel guard on http://127\.0\.0\.1:\d+ in front of http://127\.0\.0\.1:10, reading 1 "
                        r"hook\(s\); metrics not served", lines[0]), lines
    assert lines[-1] == "memtel guard stopped"


def test_a_background_task_that_ends_all_the_same_makes_the_guard_exit_1_in_one_line(monkeypatch, caplog):
    # The scrapes are supervised; were one to end anyway, the guard would decide on readings nobody updates.
    async def scrape(tracker, poll_s, timeout_s):
        raise RuntimeError("scrapes ended")

    monkeypatch.setattr(cli, "scrape_forever", scrape)
    caplog.set_level(logging.INFO, logger="memtel.guard")
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert asyncio.run(cli._serve(make_proxy(), "127.0.0.1", 0, None, 15.0)) == 1
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
            signal.signal(signal.SIGINT, signal.default_int_handler)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["memtel guard: a background task (hook scrapes, health polls) stopped: "
                      "RuntimeError('scrapes ended'); exiting"]
