"""The guard in front of two engines (--replica): each prompt goes where it fits, preferring the most room."""

from __future__ import annotations

import json
import threading
import time

import pytest

from telemetry.errors import ConfigError
from telemetry.guard.proxy import GuardLimits
from telemetry.guard.replicas import engines, hook_targets, replica_flag, replicas_file
from tests.guard.servers import RunningGuard, StubHook, StubUpstream, exposition, request
from tests.support.cli import call_main

LIMITS = {"big": 2000, "small": 800}
IN_POOL = "memtel_guard_replica_in_pool"
FORWARDED = "memtel_guard_replica_forwarded_total"


@pytest.fixture(scope="module")
def stub_engines():
    found = {}
    for name in LIMITS:
        upstream = StubUpstream()
        hook = StubHook(lambda name=name: exposition(LIMITS[name], node=f"node-{name}", rank="0", budget=4e9))
        found[name] = (upstream, hook)
    yield found
    for upstream, hook in found.values():
        upstream.stop()
        hook.stop()


@pytest.fixture(scope="module")
def guard(stub_engines):
    running = RunningGuard("", [], stale_s=0.5, limits=GuardLimits(queue_s=3.0),
                           replicas=[(up.url, [hook.url]) for up, hook in stub_engines.values()])
    running.wait_for(lambda: all(r.tracker.published is not None for r in running.proxy.replicas))
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def _clean(stub_engines, guard):
    LIMITS.update(big=2000, small=800)
    for upstream, hook in stub_engines.values():
        upstream.seen.clear()
        upstream.hold, upstream.healthy, hook.down = None, True, False
    guard.wait_for(lambda: all(guard.sample(IN_POOL, {"replica": r.name}) == 1 for r in guard.proxy.replicas))
    yield
    for upstream, _hook in stub_engines.values():
        if upstream.hold is not None:
            upstream.hold.set()


def completions(upstream: StubUpstream) -> list[int]:
    return [len(json.loads(body)["prompt"]) for _m, path, body in list(upstream.seen) if path == "/v1/completions"]


def ids(n: int) -> dict:
    return {"model": "stub", "prompt": [7] * n, "max_tokens": 4}


def test_a_long_prompt_goes_to_the_replica_where_it_fits(guard, stub_engines):
    for _ in range(3):
        status, _h, _d = request(guard.url, "POST", "/v1/completions", ids(1500))  # fits only the big one
        assert status == 200
    assert completions(stub_engines["big"][0]) == [1500] * 3 and completions(stub_engines["small"][0]) == []
    assert guard.sample(FORWARDED, {"replica": stub_engines["big"][0].url}) >= 3


def test_short_prompts_spread_by_the_room_left(guard, stub_engines):
    for upstream, _hook in stub_engines.values():
        upstream.hold = threading.Event()  # every prefill stays in progress, holding its tokens
    calls = []
    for n in range(4):
        call = threading.Thread(target=request, args=(guard.url, "POST", "/v1/completions", ids(500)), daemon=True)
        call.start()
        calls.append(call)
        guard.wait_for(lambda n=n: sum(r.tracker.in_prefill_tokens for r in guard.proxy.replicas) == 500 * (n + 1))
    # room 2000 / 800: the big one takes three (2000, 1500, 1000 left before each), then the small one has more
    assert [r.tracker.in_prefill_tokens for r in guard.proxy.replicas] == [1500, 500]
    for upstream, _hook in stub_engines.values():
        upstream.hold.set()
    for call in calls:
        call.join(5)
    assert len(completions(stub_engines["big"][0])) == 3 and len(completions(stub_engines["small"][0])) == 1


def test_a_replica_whose_health_fails_leaves_the_pool_and_comes_back(guard, stub_engines):
    big = stub_engines["big"][0]
    big.healthy = False
    guard.wait_for(lambda: guard.sample(IN_POOL, {"replica": big.url}) == 0)
    status, _h, _d = request(guard.url, "POST", "/v1/completions", ids(500))
    assert status == 200 and completions(big) == [] and completions(stub_engines["small"][0]) == [500]
    status, _h, _data = request(guard.url, "GET", "/v1/models")  # other paths: the first healthy replica
    assert status == 200 and ("GET", "/v1/models", b"") in stub_engines["small"][0].seen
    result = {}
    waiting = threading.Thread(target=lambda: result.update(answer=request(guard.url, "POST", "/v1/completions",
                                                                          ids(1500))), daemon=True)
    waiting.start()  # fits no replica in the pool: it waits for one
    guard.wait_for(lambda: guard.sample("memtel_guard_queue_depth") == 1)
    big.healthy = True
    waiting.join(5)
    assert result["answer"][0] == 200 and completions(big) == [1500]
    assert guard.sample(IN_POOL, {"replica": big.url}) == 1


def test_a_replica_whose_hooks_are_stale_leaves_the_pool(guard, stub_engines):
    big, hook = stub_engines["big"]
    hook.down = True
    guard.wait_for(lambda: guard.sample(IN_POOL, {"replica": big.url}) == 0)  # after --stale-s (0.5 s)
    assert guard.sample("memtel_guard_replica_limit_tokens", {"replica": big.url}) is None
    status, _h, _d = request(guard.url, "POST", "/v1/completions", ids(300))
    assert status == 200 and completions(big) == [] and completions(stub_engines["small"][0]) == [300]
    hook.down = False
    guard.wait_for(lambda: guard.sample(IN_POOL, {"replica": big.url}) == 1)


def test_a_replica_that_refuses_the_connection_leaves_the_pool_and_the_prompt_goes_to_another():
    """Nothing was sent to a replica that cannot be reached, so the prompt is decided again among the others (here
    before any /health poll could notice: polled once at the start, then every 60 s)."""
    dead, alive = StubUpstream(), StubUpstream()
    hooks = [StubHook(lambda: exposition(2000, node="node-dead", rank="0", budget=4e9)),
             StubHook(lambda: exposition(800, node="node-alive", rank="0", budget=4e9))]
    running = RunningGuard("", [], health_s=60.0, replicas=[(dead.url, [hooks[0].url]), (alive.url, [hooks[1].url])])
    try:
        running.wait_for(lambda: all(r.tracker.published is not None for r in running.proxy.replicas))
        dead.stop()  # the engine is gone; its hook still answers (the limit stays fresh)
        status, _h, _d = request(running.url, "POST", "/v1/completions", ids(500))  # the dead one has more room
        assert status == 200 and completions(alive) == [500]
        assert running.sample(IN_POOL, {"replica": dead.url}) == 0
        assert running.sample("memtel_guard_upstream_failures_total", {"stage": "connect"}) == 1
        status, _h, data = request(running.url, "POST", "/v1/completions", ids(1500))  # fits only the dead one
        assert status == 503 and json.loads(data)["error"]["reason"] == "would_not_fit"
    finally:
        running.stop()
        alive.stop()
        for hook in hooks:
            hook.stop()


def test_with_no_replica_healthy_a_prompt_waits_then_gets_503(guard, stub_engines):
    for upstream, _hook in stub_engines.values():
        upstream.healthy = False
    guard.wait_for(lambda: all(guard.sample(IN_POOL, {"replica": r.name}) == 0 for r in guard.proxy.replicas))
    guard.proxy.queue.queue_s = 0.3  # this test's wait only
    try:
        started = time.monotonic()
        status, headers, data = request(guard.url, "POST", "/v1/completions", ids(100))
    finally:
        guard.proxy.queue.queue_s = 3.0
    assert status == 503 and time.monotonic() - started >= 0.3 and headers["x-should-retry"] == "true"
    error = json.loads(data)["error"]
    assert error["reason"] == "no_replica" and "healthy" in error["message"]
    assert all(completions(up) == [] for up, _h in stub_engines.values())


YAML_BAD = [
    ("replicas: [", "not valid YAML"),
    ("- upstream: http://a:1\n", "expected `replicas:`"),
    ("replicas: []\n", "`replicas` is"),
    ("replicas:\n  - upstream: http://a:1\n", "expected exactly the keys upstream and hooks"),
    ("replicas:\n  - upstream: http://a:1\n    hooks: http://a:2\n", "hooks must be a list"),
    ("replicas:\n  - upstream: ftp://a:1\n    hooks: [http://a:2]\n", "base URL"),
    ("replicas:\n  - upstream: http://a:1\n    hooks: [nope]\n", "'nope' has no port"),
    ("replicas:\n  - {upstream: http://a:1, hooks: [http://a:2]}\n  - {upstream: http://a:1, hooks: [http://a:3]}\n",
     "given twice"),
]


@pytest.mark.parametrize(("text", "words"), YAML_BAD)
def test_a_bad_replicas_file_is_one_line_and_exit_2(tmp_path, text, words):
    path = tmp_path / "replicas.yaml"
    path.write_text(text)
    done = call_main(["guard", "--listen", "127.0.0.1:0", "--replicas", str(path)])
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize(("args", "words"), [
    (["--replica", "http://a:1"], "expected URL=HOOK"),
    (["--replica", "http://a:1="], "expected URL=HOOK"),
    (["--replica", "http://a:1/v2=http://a:2"], "base URL"),
    (["--replica", "http://a:1=http://a:2,,http://a:3"], "--replica"),
    (["--replica", "http://a:1=http://a:2", "--replica", "http://a:1=http://a:3"], "given twice"),
    (["--replica", "http://a:1=http://a:2", "--upstream", "http://b:1", "--hooks", "http://b:2"], "one form"),
    (["--replica", "http://a:1=http://a:2", "--replicas", "x.yaml"], "flags or a file"),
    (["--replicas", "/nonexistent/replicas.yaml"], "cannot read"),
    (["--upstream", "http://a:1"], "--hooks"),
    (["--upstream", "http://a:1", "--hooks", "http://a:2", "--queue-s", "-1"], "--queue-s"),
    (["--upstream", "http://a:1", "--hooks", "http://a:2", "--max-queued", "0"], "--max-queued"),
])
def test_bad_replica_flags_are_one_line_and_exit_2(args, words):
    done = call_main(["guard", "--listen", "127.0.0.1:0", *args])
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize("given, engine", [
    ("http://10.0.0.1:8000/v1", "http://10.0.0.1:8000"), ("http://10.0.0.1:8000/v1/", "http://10.0.0.1:8000"),
    ("https://h/V1", "https://h:443"), ("http://v1:8000", "http://v1:8000")])
def test_the_openai_sdks_base_url_is_taken_as_the_engines(given, engine):
    assert engines(given, "http://10.0.0.1:9200", None, None)[0][0].url == engine
    assert engines(None, None, [f"{given}=http://10.0.0.1:9200"], None)[0][0].url == engine


def test_an_upstream_with_another_path_is_still_refused_with_what_is_expected():
    with pytest.raises(ConfigError, match=r"--upstream: 'http://h:8000/x/v1' is not a base URL"):
        engines("http://h:8000/x/v1", "http://h:9200", None, None)


LONG = "http://" + "h" * 100   # a URL past the 80 characters an error line quotes


def message(call, *args) -> str:
    with pytest.raises(ConfigError) as error:
        call(*args)
    return str(error.value)


def test_the_hook_list_is_named_by_its_flag():
    assert message(hook_targets, LONG + ",,x") == \
        f"--hooks: {(LONG + ',,x')[:80]!r}: expected one or more hook URLs separated by commas"
    assert message(hook_targets, "ftp://h:1", "--replica").startswith("--replica: ")


def test_a_replica_flag_without_its_hooks_is_quoted_to_80_characters():
    assert message(replica_flag, LONG) == \
        f"--replica: {LONG[:80]!r}: expected URL=HOOK[,HOOK...], e.g. http://10.0.0.1:8000=http://10.0.0.1:9200"


def test_no_engine_at_all_says_both_forms():
    assert message(engines, None, None, None, None) == \
        "--upstream URL with --hooks URL[,URL...] (one engine), or --replica / --replicas (several): none given"


@pytest.mark.parametrize("text, said", [
    ("replicas:\n", "`replicas` is empty; expected `replicas:`"),
    ("replicas: [x]\n", "replica 1 has a str; expected exactly the keys upstream and hooks"),
    ("replicas: [{}]\n", "replica 1 has nothing; expected exactly the keys upstream and hooks"),
    ("replicas: [{upstream: 5, hooks: [http://h:1]}]\n", "replica 1: upstream is a int; expected the engine's base "
                                                         "URL"),
    ("replicas: [{upstream: 'http://u:1', hooks: ['ftp://h:1']}]\n", "replica 1: "),
])
def test_a_bad_replicas_file_names_the_file_and_the_replica(tmp_path, text, said):
    path = tmp_path / "replicas.yaml"
    path.write_text(text)
    assert message(replicas_file, path).startswith(f"--replicas {path}: {said}")


def _upstream(text):
    [(upstream, _hooks)] = engines(text, "http://h:9200", None, None)
    return upstream


@pytest.mark.parametrize(("text", "port", "tls"), [("http://vm", 80, False), ("https://vm", 443, True),
                                                   ("https://vm:8443/", 8443, True), ("vm:8000", 8000, False)])
def test_an_upstream_without_a_port_gets_its_schemes(text, port, tls):
    upstream = _upstream(text)
    assert (upstream.host, upstream.port, upstream.tls, upstream.path) == ("vm", port, tls, "")


@pytest.mark.parametrize("text", ["http://vm:8000/?x=1", "http://vm:8000/v2", "ftp://vm", "http://u:secret@vm:8000",
                                  "vm"])
def test_an_upstream_that_is_not_a_base_url_is_refused_with_what_is_expected(text):
    with pytest.raises(ConfigError, match=r"^--upstream: .*expected the engine's base URL") as caught:
        _upstream(text)
    assert "secret" not in str(caught.value)


def test_a_hook_without_a_port_gets_its_schemes():
    assert [h.port for h in hook_targets("https://vm,http://vm,vm:9400")] == [443, 80, 9400]
    with pytest.raises(ConfigError, match=r"^--hooks: 'vm' has no port; expected HOST:PORT or http\(s\)://"):
        hook_targets("vm")
