"""Real loopback servers for the guard's tests: a small upstream, a hook exporter, and the guard itself.

`StubUpstream` answers the slice of the OpenAI API the guard forwards (its token count is the lab's:
one whitespace-separated word, one token) and records every request it sees. `StubHook` serves the
exposition text a rank's hook exporter would, settable by the test, or stops answering. `RunningGuard`
runs the guard's proxy and its hook scraper on an event loop in a thread of the test process.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from telemetry.guard.limit import LimitTracker, scrape_forever
from telemetry.guard.metrics import GuardMetrics, guard_registry
from telemetry.guard.proxy import GuardLimits, GuardProxy
from telemetry.url import parse_base_url, parse_url


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class StubUpstream:
    """An OpenAI-style upstream: /v1/completions and chat (plain or streamed), /tokenize, /v1/models, /health."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []  # (method, path, body)
        self.gate: threading.Event | None = None  # set by a test: a streamed answer waits on it after its first chunk
        self.hold: threading.Event | None = None  # set by a test: a completion waits on it before answering
        self.tokens_per_word = 1  # what its /tokenize counts: words times this
        self.max_model_len: int | None = None  # set by a test: its /v1/models says so, as vLLM's does
        self.streamed_bytes = 0  # bytes of big streams written so far
        self.connections: list = []  # every connection accepted (to close kept-alive ones under the guard)
        self.extra_answer: bytes | None = None  # set by a test: sent after the next GET's answer (a desync)
        self.healthy = True  # set by a test: /health answers 503 while False
        self.aborted = 0  # held completions whose connection the guard closed before the answer
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with outer.lock:
                    outer.connections.append(self.connection)

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Upstream", "stub")
                self.end_headers()
                extra, outer.extra_answer = outer.extra_answer, None
                self.wfile.write(data + (extra or b""))

            def _held_until_aborted(self, hold: threading.Event) -> bool:
                """Wait for `hold` (10 s at most) while watching the connection: True when the guard closed it
                first (the request aborted, as vLLM aborts a request whose connection closes)."""
                deadline = time.monotonic() + 10
                while not hold.wait(0.02) and time.monotonic() < deadline:
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    if readable and self.connection.recv(1, socket.MSG_PEEK) == b"":
                        with outer.lock:
                            outer.aborted += 1
                        self.close_connection = True
                        return True
                return False

            def do_GET(self) -> None:
                with outer.lock:
                    outer.seen.append(("GET", self.path, b""))
                if self.path == "/health":
                    self.send_response(200 if outer.healthy else 503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/v1/models":
                    card: dict[str, object] = {"id": "stub", "object": "model"}
                    if outer.max_model_len is not None:
                        card["max_model_len"] = outer.max_model_len
                    self._json(200, {"object": "list", "data": [card]})
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError"}})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    outer.seen.append(("POST", self.path, body))
                request = json.loads(body)
                if self.path == "/tokenize":
                    if "messages" in request:
                        text = " ".join(str(m.get("content", "")) for m in request["messages"])
                    else:
                        text = request["prompt"]
                    self._json(200, {"count": len(text.split()) * outer.tokens_per_word, "max_model_len": 10**7})
                    return
                if request.get("temperature") == -1:  # an error of the upstream's own, to pass through
                    self._json(400, {"error": {"message": "temperature must be >= 0", "type": "BadRequestError",
                                               "code": 400}})
                    return
                if outer.hold is not None and self._held_until_aborted(outer.hold):
                    return
                if request.get("huge_chunk"):  # one chunk said to be 400 MiB, written 1 MiB at a time until stopped
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(b"%x\r\n" % (400 << 20))
                    piece = b"x" * (1 << 20)
                    try:
                        for _ in range(request["huge_chunk"]):
                            self.wfile.write(piece)
                            outer.streamed_bytes += len(piece)
                    except OSError:
                        pass
                    self.close_connection = True
                    return
                if request.get("big_chunks"):  # a long stream of 64 KiB chunks, counted as they are written
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    piece = b"data: " + b"x" * 65528 + b"\n\n"
                    for _ in range(request["big_chunks"]):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        outer.streamed_bytes += len(piece)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    return
                words = ["alpha", " beta", " gamma", " delta"]
                if not request.get("stream"):
                    self._json(200, {"id": "cmpl-1", "object": "text_completion", "choices": [
                        {"index": 0, "text": "".join(words), "finish_reason": "length"}]})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i, word in enumerate(words):
                    event = b"data: " + json.dumps({"choices": [{"index": 0, "text": word}]}).encode() + b"\n\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    if i == 0 and outer.gate is not None:
                        outer.gate.wait(10)
                done = b"data: [DONE]\n\n"
                self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                self.wfile.flush()

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def close_connections(self) -> None:
        """Close every connection, as a server does with kept-alive connections it times out."""
        with self.lock:
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.connections.clear()

    def paths(self) -> list[str]:
        with self.lock:
            return [path for _method, path, _body in self.seen]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def exposition(max_prefill: int, *, budget: float = 8 << 30, rank: str = "0", node: str = "node-a",
               forecast_time: float | None = None, growth: dict[int, float] | None = None,
               at_best: int | None = None) -> str:
    """A hook's /metrics lines for one rank's fit, as telemetry/hook/forecast exports them (`at_best`: the
    at-best gauge, None: a hook older than it)."""
    labels = f'rank="{rank}",node="{node}"'
    lines = ["# HELP memtel_hook_calls_total Hooked calls recorded.", "# TYPE memtel_hook_calls_total counter",
             f'memtel_hook_calls_total{{site="x",{labels}}} 3.0',
             f"memtel_forecast_max_prefill_tokens{{{labels}}} {max_prefill}",
             f"memtel_forecast_fit_budget_bytes{{{labels}}} {budget}",
             f"memtel_forecast_last_success_timestamp_seconds{{{labels}}} "
             f"{time.time() if forecast_time is None else forecast_time}"]
    for tokens, value in (growth or {}).items():
        lines.append(f'memtel_forecast_reserved_growth_bytes{{tokens="{tokens}",{labels}}} {value}')
    if at_best is not None:
        lines.append(f"memtel_forecast_max_prefill_tokens_at_best{{{labels}}} {at_best}")
    return "\n".join(lines) + "\n"


class StubHook:
    """A hook exporter's /metrics: `text` (a callable, so timestamps stay current), or down."""

    def __init__(self, text: Any) -> None:
        self.text = text
        self.down = False
        self.scrapes = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.scrapes += 1
                if outer.down:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = (outer.text() if callable(outer.text) else outer.text).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RunningGuard:
    """The guard's proxy and hook scraper on their own event loop, in a thread of the test process."""

    def __init__(self, upstream: str, hooks: list[str], *, when_blind: str = "admit", stale_s: float = 2.0,
                 poll_s: float = 0.05, health_s: float | None = None, reserve_mb: float = 0.0,
                 limits: GuardLimits | None = None,
                 replicas: list[tuple[str, list[str]]] | None = None) -> None:
        """replicas: (upstream, hooks) of each of several engines, instead of `upstream` and `hooks`. Without
        `limits`, the queue is off (a prompt that does not fit is refused at once, as the refusal tests read it); the
        default queue has its own tests (test_queue.py)."""
        limits = limits or GuardLimits(queue_s=0.0)
        engines = [(parse_base_url(url), LimitTracker([parse_url(h) for h in urls], stale_s=stale_s,
                                                       reserve_bytes=reserve_mb * (1 << 20)))
                   for url, urls in (replicas or [(upstream, hooks)])]
        self.metrics = GuardMetrics()
        self.proxy = GuardProxy(*engines[0], self.metrics, when_blind=when_blind, limits=limits, replicas=engines)
        self.tracker = self.proxy.tracker
        self.registry = guard_registry(self.metrics, self.tracker, self.proxy.replicas)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.port = 0

        async def main() -> None:
            self.port = await self.proxy.start("127.0.0.1", 0)
            self._tasks = [asyncio.ensure_future(scrape_forever(r.tracker, poll_s, timeout_s=1.0))
                           for r in self.proxy.replicas]
            if len(self.proxy.replicas) > 1:
                self._tasks.append(asyncio.ensure_future(self.proxy.watch_health(health_s or poll_s, timeout_s=1.0)))
            started.set()

        def serve() -> None:
            self.loop.run_until_complete(main())
            self.loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the guard did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_for(self, condition: Any, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"not reached within {timeout} s: {condition}")
            time.sleep(0.01)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.registry.get_sample_value(name, labels or {})

    def stop(self) -> None:
        async def shutdown() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.proxy.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def make_proxy(replicas: int = 1, **options: Any) -> GuardProxy:
    """A guard's proxy in this process, not started, in front of `replicas` engines that nobody answers."""
    engines = [(parse_base_url(f"http://127.0.0.1:{10 + i}"), LimitTracker([parse_url(f"http://127.0.0.1:{20 + i}")],
                                                                           stale_s=5)) for i in range(replicas)]
    return GuardProxy(*engines[0], GuardMetrics(), replicas=engines, **options)


def request(url: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: (status, headers with lower-case names, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes, answers: int = 1, timeout: float = 10.0) \
        -> list[tuple[int, dict[str, str], bytes]]:
    """Send raw bytes on a fresh connection, read `answers` responses: (status, headers, body) each."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        stream = sock.makefile("rb")
        got = []
        for _ in range(answers):
            response = http.client.HTTPResponse(_Made(stream))  # type: ignore[arg-type]
            response.begin()
            got.append((response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()))
        return got


class _Made:
    """A socket whose makefile() is one shared stream that a response cannot close, so pipelined answers are
    read in turn."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def makefile(self, *_args: Any) -> Any:
        return self

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


__all__ = ["RunningGuard", "StubHook", "StubUpstream", "exposition", "raw_exchange", "request"]
