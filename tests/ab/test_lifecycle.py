"""harness/ab/lifecycle.py without servers: the arm's server as the run records it, against an
httpx.MockTransport. (Starting and stopping real processes: tests/ab/test_lab_ladder.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from harness.ab.config import Arm, Ladder, Step
from harness.ab.lifecycle import ArmServer, expand, max_model_len, relative_to_run
from harness.ab.records import ServerInfo
from harness.ab.redact import Redactor
from harness.ab.status import Status

URL = "http://127.0.0.1:9"


class Records:
    def __init__(self) -> None:
        self.records: list[Any] = []

    def write(self, record: Any) -> Any:
        self.records.append(record)
        return record


def ladder() -> Ladder:
    return Ladder(model="m", arms=(Arm("a", URL),), steps=(Step("s1", 1000, 1),))


def test_expand_relative_paths_and_max_model_len(tmp_path: Path):
    assert expand("{run_dir}/logs/{arm}-r{repeat}.log", {"run_dir": "/r", "arm": "a", "repeat": "2"}) == \
        "/r/logs/a-r2.log"
    assert relative_to_run(tmp_path, tmp_path / "logs" / "x.log") == "logs/x.log"
    assert relative_to_run(tmp_path, Path("/elsewhere/x.log")) == "/elsewhere/x.log"
    models = {"data": [{"id": "other", "max_model_len": 10}, {"id": "m", "max_model_len": 2048}]}
    assert max_model_len(models, "m") == 2048 and max_model_len(models, "auto") == 10
    assert max_model_len({"data": [{"id": "m", "max_model_len": True}]}, "m") is None
    assert max_model_len("HTTP 404", "m") is None


def arm_server(tmp_path: Path, handle: Any) -> tuple[ArmServer, Records, list[str]]:
    records, logs = Records(), []
    client = httpx.Client(transport=httpx.MockTransport(handle))
    server = ArmServer(tmp_path, records, client, Status(), Redactor.for_ladder(ladder()), logs.append,  # type: ignore[arg-type]
                       model="m")
    return server, records, logs


def test_server_info_records_versions_models_and_ranks_that_do_not_answer(tmp_path: Path):
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.1"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        if request.url.host == "127.0.0.2":
            return httpx.Response(200, text="# metrics")
        return httpx.Response(500)

    server, records, logs = arm_server(tmp_path, handle)
    ranks = {"rank0": "http://127.0.0.2:1/metrics", "rank1": "http://127.0.0.3:1/metrics"}
    assert server.info(Arm("a", URL), 0, ranks) == 4096
    info = records.records[0]
    assert isinstance(info, ServerInfo) and info.version == {"version": "0.1"}
    assert list(info.rank_errors) == ["rank1"] and "HTTPStatusError" in info.rank_errors["rank1"]
    assert logs and "warning: rank rank1 not reachable" in logs[0]


def test_an_external_arm_is_alive_while_its_health_answers_200_and_stop_without_a_server_writes_nothing(
        tmp_path: Path):
    codes = iter([200, 503])
    server, records, _ = arm_server(tmp_path, lambda request: httpx.Response(next(codes)))
    assert server.alive(Arm("a", URL)) is True
    assert server.alive(Arm("a", URL)) is False
    server.stop()
    assert records.records == []


def test_a_served_arm_is_started_recorded_with_its_expanded_env_and_hook_log_dir_and_stopped(tmp_path: Path):
    """A real (tiny) process: python's http.server on a loopback port stands in for the engine."""
    import sys

    from harness.ab.config import ServeSpec
    from harness.ab.records import ServeReady, ServeStart, ServeStop
    from tests.support.ports import free_port

    port = free_port()
    spec = ServeSpec(command=(sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"),
                     health_url=f"http://127.0.0.1:{port}/", env={"WHERE": "{run_dir}/{arm}-r{repeat}",
                                                                  "MEMTEL_TARGETS": "x"},
                     startup_timeout_s=30, stop_grace_s=5)
    arm = Arm("a", f"http://127.0.0.1:{port}", serve=spec)
    health = {"code": 200}
    asked: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return httpx.Response(health["code"])

    server, records, logs = arm_server(tmp_path, handle)
    try:
        server.start(arm, 1)
        assert server.alive(arm)
        # Running but not answering its health URL (killed a moment ago, or its engine died): not alive.
        health["code"] = 503
        assert not server.alive(arm)
        assert asked == [spec.health_url, spec.health_url]
    finally:
        server.stop()
    start, ready, stop = records.records
    assert isinstance(start, ServeStart) and isinstance(ready, ServeReady) and isinstance(stop, ServeStop)
    assert start.env["WHERE"] == f"{tmp_path.resolve()}/a-r1"
    assert start.env["MEMTEL_LOG_DIR"] == f"{tmp_path.resolve()}/hook-logs/a-r1"  # added: the hook is asked for
    assert (tmp_path / "hook-logs" / "a-r1").is_dir() and start.hook_log_dir == "hook-logs/a-r1"
    assert start.log == "logs/a-r1-serve.log" and (tmp_path / start.log).is_file()
    assert stop.pgid == start.pid and stop.how == "sigterm" and stop.exit_code is not None
    assert server.process is None and "server ready in" in logs[0]
