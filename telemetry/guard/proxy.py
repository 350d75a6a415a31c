"""The guard's reverse proxy: each completion's prompt sized and decided by the admission core
(telemetry/admission), the decision performed, the rest passed through.

The proxy is three parts and this glue: the connection server (server.py: connections, framing, bounds), the
upstream client (upstream.py: kept-alive connections, one exchange, a forward relayed as it arrives), and the core's
decisions performed here (`_guarded`): CountFirst (the upstream's /tokenize), ReadModels (its /v1/models), Hold (the
queue's thin waiter, queue.py), Forward (its tokens held until the answer's first byte: the prefill is over) and the
refusals (refusal.py's OpenAI-style errors: 400 with `x-should-retry: false` for a prompt no retry can fit, 503 with
`Retry-After` and `x-should-retry: true` for one that does not fit now).

`/v1/completions`, `/v1/chat/completions` and `/v1/responses` are sized (telemetry/admission/prompt.py). The paths
in `PASS_THROUGH` go upstream unchanged. Any other path is answered 404 here: an endpoint that runs a prefill the
guard does not size (`/v1/embeddings`, SGLang's `/generate`) must not reach the engine around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from telemetry.admission.core import WHEN_BLIND, Admission, Prompt, Settings
from telemetry.admission.decisions import CountFirst, Forward, Hold, ReadModels
from telemetry.admission.prompt import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    RESPONSES,
    PromptError,
    PromptSize,
    measure,
    parse_body,
)
from telemetry.admission.readings import MAX_PREFILL, MAX_TOKENS, NO_GAUGE_HINT
from telemetry.admission.refusal import MAX_MODELS_BYTES, MODELS_PATH, RETRY_AFTER_S, Refusal, error_body, parse_models
from telemetry.catalogue import metrics as catalogue
from telemetry.catalogue.fields import (
    GUARD_BAD_REQUEST,
    GUARD_BLIND,
    GUARD_NOT_FORWARDED,
    GUARD_UPSTREAM_ERROR,
    GUARD_UPSTREAM_UNAVAILABLE,
)
from telemetry.errors import ConfigError, printable
from telemetry.guard.bounds import GuardLimits
from telemetry.guard.http import HttpError, Request, ServerSide, UpstreamError
from telemetry.guard.limit import LimitTracker, fetch_metrics
from telemetry.guard.metrics import GuardMetrics
from telemetry.guard.queue import Waiters, now
from telemetry.guard.server import ConnectionServer
from telemetry.guard.upstream import JSON, Replica, Unreachable, UpstreamClient, answer
from telemetry.url import Endpoint

log = logging.getLogger("memtel.guard")

GUARDED = (COMPLETIONS, CHAT_COMPLETIONS, RESPONSES)
# Paths that run no prefill, passed through unchanged (GET also answers HEAD).
PASS_THROUGH = {"GET": ("/v1/models", "/health", "/ping", "/version", "/metrics", "/get_model_info"),
                "POST": ("/tokenize", "/detokenize")}
MODEL_PATH_PREFIX = "/v1/models/"
MODELS_TIMEOUT_S = 2.0
# The header a relayed /health answer carries while a replica's hooks answer without the forecast (docs/guard.md).
BLIND_HEADER = "x-memtel-guard-blind"
MAX_BLIND_HEADER_CHARS = 1000
# Bodies larger than this are parsed and counted in a worker thread, so a 64 MiB body (most of a second of
# JSON parsing) does not stop the event loop that serves every other connection and stream for that long.
# Smaller ones, a 1M-token prompt included (4 to 8 MB, 30 to 60 ms here), are parsed on the loop: handing
# them to a thread made the 1M-token refusal about 25 ms slower at the median (BENCHMARKS.md, "memtel guard").
INLINE_PARSE_BYTES = 8 << 20
# A body of many small objects (500,000 one-word chat messages are 7.5 MB) costs by its objects, not its bytes: one
# with more than this many is parsed in the worker thread too, whatever its size (the count is one pass in C).
INLINE_PARSE_OBJECTS = 10_000
# What a body that cannot be parsed raises besides PromptError: a 5,000-digit integer is a ValueError of
# int()'s digit limit, deep nesting a RecursionError. Each is the client's error: a 400, never a traceback.
_BODY_ERRORS = (PromptError, ValueError, TypeError, RecursionError, MemoryError)


class GuardProxy:
    def __init__(self, upstream: Endpoint, tracker: LimitTracker, metrics: GuardMetrics, *,
                 when_blind: str = "admit", limits: GuardLimits | None = None,
                 replicas: list[tuple[Endpoint, LimitTracker]] | None = None) -> None:
        """upstream, tracker: the one replica; or `replicas` (upstream, tracker) each, the first standing for
        `upstream` and `tracker` then."""
        if when_blind not in WHEN_BLIND:
            raise ConfigError(f"--when-blind: expected one of {', '.join(WHEN_BLIND)}, got {when_blind!r}")
        self.metrics = metrics
        self.when_blind = when_blind
        self.limits = limits or GuardLimits()
        self.replicas = [Replica(u, t, self.limits) for u, t in (replicas or [(upstream, tracker)])]
        first = self.replicas[0]
        self.upstream, self.tracker = first.upstream, first.tracker
        self.core = Admission(self.replicas, Settings(when_blind, self.limits.queue_s, self.limits.max_queued))
        self.queue = self.core.line  # its settings (queue_s, pass_s, max_queued) and its waiters
        self.waiters = Waiters(self.core, metrics)
        for replica in self.replicas:
            replica.tracker.subscribe(self.waiters.kick)
        self.server = ConnectionServer(self.limits, metrics, self._handle)
        self.client = UpstreamClient(self.limits, metrics)

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        """Listen; the port actually bound (port 0 picks one)."""
        return await self.server.start(host, port)

    async def stop(self) -> None:
        await self.server.stop()
        for replica in self.replicas:
            replica.pool.close()
        await asyncio.sleep(0)  # the closed transports' connection_lost (which closes their sockets) runs now

    @property
    def open_connections(self) -> int:
        return self.server.open_connections

    @property
    def _server(self) -> asyncio.base_events.Server | None:
        return self.server._server

    # -- one request ----------------------------------------------------------------------------------
    async def _handle(self, request: Request, body: bytes, client: ServerSide, started: float) -> None:
        method, path = request.method, request.target.split("?", 1)[0]
        if path in GUARDED:
            if method != "POST":
                return await self._refuse_path(client, 405, f"{path} takes POST, not {method}")
            return await self._guarded(request, path, body, client, started)
        gets = PASS_THROUGH["GET"]
        if path == "/health" and self.when_blind == "reject" and all(r.tracker.limit() is None for r in self.replicas):
            # Refusing every completion while blind, the service is down for clients: say so where load
            # balancers and the harness look (and a guard that has not seen its first forecast is not ready).
            self.metrics.count(catalogue.GUARD_REJECTED, "blind")
            message = f"memtel guard: blind (--when-blind reject): {self._why_blind()}"
            return await self._answer(client, 503, error_body(GUARD_BLIND, message, 503),
                                      (("Retry-After", str(RETRY_AFTER_S["blind"])),))
        if (method in ("GET", "HEAD") and (path in gets or path.startswith(MODEL_PATH_PREFIX))) or \
                (method == "POST" and path in PASS_THROUGH["POST"]):
            self.metrics.count(catalogue.GUARD_PASSED_THROUGH)
            replica = next((r for r in self.replicas if r.healthy), self.replicas[0])
            extra = self._without_gauge_header() if path == "/health" else ()
            return await self.client.forward(replica, request, body, client, started, None, extra=extra)
        known = ", ".join([*GUARDED, *gets, *PASS_THROUGH["POST"]])
        return await self._refuse_path(client, 404, f"{method} {path[:100]} is not forwarded by the memtel guard "
                                                    f"(it forwards {known})")

    def _without_gauge_header(self) -> tuple[tuple[str, str], ...]:
        """While a hook answers without the forecast, or the guard is blind, /health says so (the status stays the
        engine's: a load balancer must not take a serving engine out for it)."""
        hooks = [url for r in self.replicas for url in r.tracker.without_gauge()]
        if hooks:
            return ((BLIND_HEADER, f"{len(hooks)} hook(s) export no {MAX_PREFILL}, e.g. {hooks[0]}: "
                                   f"{NO_GAUGE_HINT}"),)
        if all(r.tracker.limit() is None for r in self.replicas):
            why = printable(f"blind (--when-blind {self.when_blind}): {self._why_blind()}", MAX_BLIND_HEADER_CHARS)
            return ((BLIND_HEADER, why.encode("ascii", "backslashreplace").decode("ascii")),)
        return ()

    async def _refuse_path(self, client: ServerSide, status: int, message: str) -> None:
        self.metrics.count(catalogue.GUARD_REJECTED, "not_forwarded")
        await self._answer(client, status, error_body(GUARD_NOT_FORWARDED, message, status))

    async def _guarded(self, request: Request, path: str, raw: bytes, client: ServerSide, started: float) -> None:
        try:
            if len(raw) > INLINE_PARSE_BYTES or (len(raw) > 2 * INLINE_PARSE_OBJECTS
                                                 and raw.count(b"{") > INLINE_PARSE_OBJECTS):
                # a long prompt, or one of many objects, takes tens of ms to parse: not on the event loop
                size = await asyncio.to_thread(_measure_all, path, raw)
            else:
                size = measure(path, parse_body(raw))
        except _BODY_ERRORS as exc:
            self.metrics.count(catalogue.GUARD_REJECTED, "bad_request")
            await self._answer(client, 400, error_body(GUARD_BAD_REQUEST, _body_error(exc), 400))
            return
        prompt = Prompt(size)
        try:
            await self._perform(prompt, request, path, raw, client, started)
        finally:
            if prompt.waiting is not None:  # it ended while it waited (the guard stopping): its place is freed
                self.waiters.ended("client_left", self.core.leave(prompt, now()))

    async def _perform(self, prompt: Prompt, request: Request, path: str, raw: bytes, client: ServerSide,
                       started: float) -> None:
        """Perform the core's decisions for `prompt` until it is forwarded or refused."""
        tried = 0
        while True:
            decision = self.core.decide(prompt, now())
            if isinstance(decision, CountFirst):
                await self._count(decision, request, prompt)
                continue
            if isinstance(decision, ReadModels):
                await self._read_models(_ours(decision.replica), request)
                continue
            if isinstance(decision, Hold):
                if not await self.waiters.wait(prompt, decision, client.channel.gone()):
                    raise ConnectionResetError("the client left while its request waited")
                continue
            if not isinstance(decision, Forward):  # a refusal
                self.waiters.ended(decision.queue_outcome, decision.waited_s)
                if decision.counted_as is not None:
                    self.metrics.count(catalogue.GUARD_REJECTED, decision.counted_as)
                if decision.reason is None and decision.counted_as == "blind":
                    self.metrics.count(catalogue.GUARD_BLIND_DECISIONS, "reject")
                self.metrics.observe_added(time.perf_counter() - started)
                await self._answer(client, decision.status, decision.body, decision.headers)
                return
            self.waiters.ended(decision.queue_outcome, decision.waited_s)
            if decision.counted_by == "blind":
                self.metrics.count(catalogue.GUARD_BLIND_DECISIONS, "admit")
            self.metrics.count(catalogue.GUARD_ADMITTED, path, decision.counted_by)
            if await self._forward(decision, request, raw, client, started):
                return
            tried += 1  # the replica refused the connection: it left the pool; decided again among the others
            if tried >= len(self.replicas):
                none_left = self.core.no_replica()  # every replica was tried and refused the connection
                self.metrics.count(catalogue.GUARD_REJECTED, "no_replica")
                await self._answer(client, none_left.status, none_left.body, none_left.headers)
                return

    async def _forward(self, forward: Forward, request: Request, raw: bytes, client: ServerSide,
                       started: float) -> bool:
        """Perform a Forward; False when its replica refused the connection (it left the pool)."""
        replica = _ours(forward.replica)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.core.release(forward, now())
                replica.tracker.notify()

        try:
            await self.client.forward(replica, request, raw, client, started, release,
                                      unreachable_raises=len(self.replicas) > 1)
            return True
        except Unreachable as down:
            released = True
            if self.core.unreachable(forward, str(down), now()):
                log.warning("memtel guard: replica %s leaves the pool: %s", replica.name, down)
            replica.tracker.notify()
            return False
        finally:
            release()

    async def _count(self, decision: CountFirst, request: Request, prompt: Prompt) -> None:
        """Perform a CountFirst: the upstream's exact count, or its answer (relayed where it matters)."""
        replica = _ours(decision.replica)
        body = json.dumps(decision.body, ensure_ascii=False).encode()
        headers = _credentials(request)
        headers.append(("Content-Type", JSON))
        self.metrics.count(catalogue.GUARD_TOKENIZE_CALLS)
        try:
            status, data = await self.client.exchange(replica, "POST", "/tokenize", headers, body)
        except (OSError, asyncio.TimeoutError, UpstreamError, HttpError) as exc:
            self.metrics.count(catalogue.GUARD_UPSTREAM_FAILURES, "tokenize")
            prompt.not_counted(Refusal(502, error_body(GUARD_UPSTREAM_UNAVAILABLE, f"memtel guard: the upstream could "
                                                       f"not count the prompt's tokens (/tokenize): {exc}", 502)))
            return
        count = None
        if status == 200:
            with contextlib.suppress(ValueError, AttributeError):
                count = json.loads(data).get("count")
        # A count past 2^31 tokens is no engine's: not a count (the readings' bound, as a hook's gauges).
        if status == 200 and isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= MAX_TOKENS:
            prompt.counted(count)
            return
        try:
            relayed = json.loads(data)
        except ValueError:
            relayed = None
        if not isinstance(relayed, dict) or status == 200:  # a 200 without a usable count is no error to relay
            relayed = error_body(GUARD_UPSTREAM_ERROR, f"memtel guard: the upstream's /tokenize answered {status} "
                                 "without a token count", 502)
        prompt.not_counted(Refusal(status if status != 200 else 502, relayed, None))

    async def _read_models(self, replica: Replica, request: Request) -> None:
        """Perform a ReadModels: one read of the replica's /v1/models at a time; the others wait for it."""
        if replica.models_reading is None:
            replica.models_reading = asyncio.ensure_future(self._models(replica, _credentials(request)))
        reading = replica.models_reading
        await asyncio.shield(reading)  # a client that goes away does not cancel the others' read
        if replica.models_reading is reading:
            replica.models_reading = None

    async def _models(self, replica: Replica, headers: list[tuple[str, str]]) -> None:
        found = None
        try:
            status, data = await asyncio.wait_for(self.client.exchange(replica, "GET", MODELS_PATH, headers, b""),
                                                  MODELS_TIMEOUT_S)
            if status == 200 and len(data) <= MAX_MODELS_BYTES:
                found = parse_models(data)
        except Exception:  # unknown max-model-len: the refusal is transient, never a failure of its own
            found = None
        self.core.models_read(replica, found, now())

    def _why_blind(self) -> str:
        current = now()
        return self.core.pool.why_blind(current.monotonic, current.wall)

    async def watch_health(self, poll_s: float, timeout_s: float) -> None:
        """Poll every replica's /health every `poll_s`: one that fails leaves the pool, and comes back when it
        answers 200 again (the queue is woken then)."""
        targets = [r.upstream.at(r.upstream.port, "/health") for r in self.replicas]

        async def one(replica: Replica, target: Endpoint) -> None:
            try:
                await fetch_metrics(target, timeout_s)
            except Exception as exc:  # supervised: any failure takes the replica out, and the polls go on
                if self.core.pool.leave(replica, printable(f"/health: {type(exc).__name__}: {exc}", 200)):
                    log.warning("memtel guard: replica %s leaves the pool: %s", replica.name, replica.health_error)
                return
            if self.core.pool.back(replica):
                log.warning("memtel guard: replica %s is healthy again: back in the pool", replica.name)
            self.waiters.kick()

        while True:
            started = time.monotonic()
            await asyncio.gather(*(one(r, t) for r, t in zip(self.replicas, targets, strict=True)))
            await asyncio.sleep(max(0.0, poll_s - (time.monotonic() - started)))

    async def _answer(self, client: ServerSide, status: int, payload: dict[str, Any],
                      extra: tuple[tuple[str, str], ...] = (), *, close: bool = False) -> None:
        await answer(client, status, payload, self.limits.send_timeout_s, extra, close=close)


def _ours(replica: object) -> Replica:
    """The core hands back the replicas it was given: the guard's own."""
    assert isinstance(replica, Replica)
    return replica


def _credentials(request: Request) -> list[tuple[str, str]]:
    return [(k, v) for k, v in request.headers if k.lower() in ("authorization", "x-api-key")]


def _measure_all(path: str, raw: bytes) -> PromptSize:
    size = measure(path, parse_body(raw))
    _ = size.least_tokens  # counted here too, off the event loop (it is cached on the object)
    return size


def _body_error(exc: BaseException) -> str:
    """One line for a body that cannot be parsed: PromptError's own, else what the parser said."""
    if isinstance(exc, PromptError):
        return str(exc)
    what = str(exc).splitlines()[0].split("; use sys.")[0][:160] if str(exc) else type(exc).__name__
    return f"malformed JSON in the request body: {what}; expected a JSON object"  # int()'s advice is not the client's


__all__ = ["BLIND_HEADER", "GUARDED", "PASS_THROUGH", "WHEN_BLIND", "GuardLimits", "GuardProxy", "Replica",
           "error_body"]
