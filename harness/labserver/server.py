"""The lab server's HTTP front end: the slice of vLLM's OpenAI-compatible API the harness uses.

Endpoints: `/v1/models`, `/v1/completions` (streamed as server-sent events like vLLM's, or not, with
`usage`), `/v1/chat/completions` (the same engine behind the chat shape), `/tokenize`, `/health`,
`/version`, `/metrics` (vLLM's metric names: `vllm:time_to_first_token_seconds`, prompt and
generation token counters, prefix-cache queries and hits), and the lab's own `POST /lab/tenant` (another process
takes some of the node's emulated memory for a while: tenant.py). Errors are vLLM-shaped JSON with the HTTP
status as `code`. Standard library only: `ThreadingHTTPServer`, one thread per connection; the engine
runs one prefill at a time, as vLLM's scheduler does for long prompts sent one client at a time.

The model does not generate language: after the prefill it emits `max_tokens` filler words, one per
decode step (the cost model's decode time on the simulator).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from harness.labserver.engine import EngineError, EngineOutOfMemoryError, LabEngine
from harness.labserver.node_memory import GIB
from harness.labserver.tokenizer import WhitespaceTokenizer
from telemetry import limits
from telemetry.argtypes import number_text
from telemetry.catalogue import COUNTER, GAUGE, HISTOGRAM, Family, vllm
from telemetry.catalogue.metrics import LAB_INDEXER_LAUNCHES
from telemetry.errors import MemtelError

log = logging.getLogger("memtel.lab.server")

# vLLM 0.32's buckets for vllm:time_to_first_token_seconds (v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM 0.32's buckets for vllm:iteration_tokens_total (v1/metrics/buckets.py).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_INSTRUMENTS: dict[str, Any] = {COUNTER: Counter, GAUGE: Gauge, HISTOGRAM: Histogram}
FILLER_WORDS = ("lab", "model", "output", "token")
MAX_BODY_BYTES = 64 << 20  # a 200k-word prompt is ~1.5 MB; refuse absurd bodies early


# vLLM's answer when its engine core died (vllm/v1/engine/exceptions.py, EngineDeadError; 0.32).
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class ApiError(MemtelError):
    """A request the server refuses; rendered as vLLM's error JSON (never shown as a command's error)."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param

    def body(self) -> dict:
        # The flat fields are vLLM's error shape up to 0.10; `error` is the nested shape of newer vLLM
        # (0.32). Clients of either (and the openai package, which reads `error` first) find the message.
        info = {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        return {"object": "error", **info, "error": info}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


@dataclass(frozen=True)
class CompletionRequest:
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    chat: bool
    model: str


class LabMetrics:
    """vLLM-named Prometheus metrics, labelled like vLLM's (`model_name`, `engine`): names, help and labels from the
    catalogue's entries (telemetry/catalogue/vllm.py, and memtel's own LAB_INDEXER_LAUNCHES)."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no `_created` series, as vLLM's /metrics has none
        self.registry = CollectorRegistry()
        values = {"model_name": model_name, "engine": "0"}

        def metric(entry: Family, **options: Any) -> Any:
            kind = _INSTRUMENTS[entry.type]
            return kind(entry.name, entry.help, list(entry.labels), registry=self.registry, **options)

        self.prompt_tokens = metric(vllm.PROMPT_TOKENS).labels(**values)
        self.generation_tokens = metric(vllm.GENERATION_TOKENS).labels(**values)
        self.prompt_tokens_cached = metric(vllm.PROMPT_TOKENS_CACHED).labels(**values)
        self.prefix_cache_queries = metric(vllm.PREFIX_CACHE_QUERIES).labels(**values)
        self.prefix_cache_hits = metric(vllm.PREFIX_CACHE_HITS).labels(**values)
        self._success = metric(vllm.REQUEST_SUCCESS)
        self.success_length = self._success.labels(**values, finished_reason="length")
        self.ttft = metric(vllm.TIME_TO_FIRST_TOKEN, buckets=TTFT_BUCKETS).labels(**values)
        self.e2e = metric(vllm.E2E_REQUEST_LATENCY, buckets=LATENCY_BUCKETS).labels(**values)
        self.prefill_time = metric(vllm.REQUEST_PREFILL_TIME, buckets=LATENCY_BUCKETS).labels(**values)
        self.running = metric(vllm.NUM_REQUESTS_RUNNING).labels(**values)
        self.waiting = metric(vllm.NUM_REQUESTS_WAITING).labels(**values)
        # vLLM's engine steps and their tokens: here one step for a prefill (counted when it ends, as its tokens
        # are) and one per output token. MemtelEngineStalled reads its count as progress.
        self.iteration_tokens = metric(vllm.ITERATION_TOKENS, buckets=ITERATION_TOKENS_BUCKETS).labels(**values)
        self.launches = metric(LAB_INDEXER_LAUNCHES).labels(**values)


class LabService:
    """Request semantics over the engine; the HTTP handler only parses and renders."""

    def __init__(self, engine: LabEngine, model_name: str, max_model_len: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = WhitespaceTokenizer()
        self.metrics = LabMetrics(model_name)
        self.created = int(time.time())
        self._engine_lock = threading.Lock()

    # --- parsing ---

    def parse_completion(self, body: Any, chat: bool) -> CompletionRequest:
        if not isinstance(body, dict):
            raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model", self.model_name)
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        prompt_ids = self._chat_prompt(body.get("messages")) if chat else self._prompt_ids(body.get("prompt"))
        max_tokens = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens", 16)
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise bad_request(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
        if body.get("n", 1) != 1:
            raise bad_request("only n=1 is supported by the lab server", "n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad_request(f"stream must be true or false, got {stream!r}", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if options and not stream:
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        temperature = body.get("temperature", 1.0)
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
            raise bad_request(f"temperature must be a number, got {temperature!r}", "temperature")
        self._check_length(len(prompt_ids), max_tokens)
        # Like vLLM 0.32: the output is capped at what still fits in the context.
        max_tokens = min(max_tokens, self.max_model_len - len(prompt_ids))
        return CompletionRequest(prompt_ids, max_tokens, stream, bool(options.get("include_usage")), chat,
                                 self.model_name)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in prompt):
            ids = list(prompt)
        elif prompt is None:
            raise bad_request("`prompt` is required: a string or a list of token ids", "prompt")
        else:
            raise bad_request("`prompt` must be a string, a list of token ids, or a list of one of those "
                              "(batches of several prompts are not supported by the lab server)", "prompt")
        if not ids:
            raise bad_request("The prompt cannot be empty.", "prompt")
        return ids

    def _chat_prompt(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise bad_request("`messages` must be a non-empty list of {role, content}", "messages")
        words: list[int] = []
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # content parts: keep the text ones
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise bad_request(f"messages[{i}].content must be a string", "messages")
            words.extend(self.tokenizer.encode(content))
        if not words:
            raise bad_request("The prompt cannot be empty.", "messages")
        return words

    def _check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {prompt_tokens} input tokens, which exceeds this limit even without any output "
                f"tokens. Please reduce the length of the input prompt.", "input_tokens")
        if prompt_tokens == self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {prompt_tokens} input tokens, which leaves no room for any output tokens. "
                f"Please reduce the length of the input prompt.", "input_tokens")

    def tokenize(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        if "messages" in body:
            ids = self._chat_prompt(body["messages"])
            words = None
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("`prompt` must be a string", "prompt")
            ids = self.tokenizer.encode(prompt)
            words = prompt.split()
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": words if body.get("return_token_strs") else None}

    def tenant(self, body: Any) -> dict:
        """`POST /lab/tenant {"gib": G, "seconds": S}`: another process holds G GiB of the node now (0: gives it
        back), for S seconds (absent: until the next call)."""
        tenant = self.engine.tenant
        if tenant is None:
            raise bad_request("this lab node has no emulated memory for another tenant to take: start it with "
                              "--capacity-gb (and --allocator sim)")
        if not isinstance(body, dict) or set(body) - {"gib", "seconds"}:
            raise bad_request('expected a JSON object {"gib": G, "seconds": S} (seconds optional)')
        asked_gib, asked_seconds = body.get("gib"), body.get("seconds")
        gib = _number_in(asked_gib, 0, limits.MAX_CAPACITY_GIB)
        if gib is None:
            most = number_text(limits.MAX_CAPACITY_GIB)
            raise bad_request(f"gib must be a number in 0..{most}, got {asked_gib!r}"[:200], "gib")
        seconds = None if asked_seconds is None else _number_in(asked_seconds, 0, limits.MAX_TENANT_S, above_low=True)
        if asked_seconds is not None and seconds is None:
            most = number_text(limits.MAX_TENANT_S)
            raise bad_request(f"seconds must be a number in (0, {most}], got {asked_seconds!r}"[:200], "seconds")
        asked = int(gib * GIB)
        tenant.hold(asked, seconds)
        return {"asked_bytes": asked, "node_capacity_bytes": tenant.node.capacity_bytes,
                "node_free_bytes": tenant.node.free_bytes(), **tenant.describe()}

    # --- running ---

    def run(self, request: CompletionRequest, arrival: float) -> Iterator[tuple[str, dict]]:
        """Yields ("token", {...}) per output token, then ("done", {usage...}). Errors raise ApiError."""
        self.metrics.waiting.inc()
        with self._engine_lock:
            self.metrics.waiting.dec()
            self.metrics.running.inc()
            try:
                outcome = self.engine.prefill(request.prompt_ids)
            except EngineOutOfMemoryError:
                # vLLM answers an engine core's death so (EngineDeadError: 500, then the server shuts down).
                raise ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError") from None
            except EngineError as exc:
                raise ApiError(500, f"the lab engine failed: {exc}", "InternalServerError") from None
            finally:
                self.metrics.running.dec()
        first = time.perf_counter()
        ttft = first - arrival
        self.metrics.ttft.observe(ttft)
        self.metrics.prefill_time.observe(outcome.seconds)
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        self.metrics.iteration_tokens.observe(len(request.prompt_ids))
        self.metrics.prompt_tokens_cached.inc(outcome.cached_tokens)
        self.metrics.prefix_cache_queries.inc(len(request.prompt_ids))
        self.metrics.prefix_cache_hits.inc(outcome.cached_tokens)
        self.metrics.launches.inc(outcome.launches)
        decode_s = self.engine.decode_seconds(1)
        for index in range(request.max_tokens):
            if index:
                time.sleep(decode_s)
            self.metrics.generation_tokens.inc()
            self.metrics.iteration_tokens.observe(1)
            yield "token", {"index": index, "text": (" " if index else "") + FILLER_WORDS[index % len(FILLER_WORDS)]}
        self.metrics.e2e.observe(time.perf_counter() - arrival)
        self.metrics.success_length.inc()
        usage = {"prompt_tokens": len(request.prompt_ids), "completion_tokens": request.max_tokens,
                 "total_tokens": len(request.prompt_ids) + request.max_tokens,
                 "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}
        yield "done", {"usage": usage, "ttft_s": ttft}


class LabHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "memtel-lab"
    service: LabService  # set on the subclass made by make_server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    # --- plumbing ---

    def _send_json(self, status: int, payload: Any, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: ApiError) -> None:
        self._send_json(error.status, error.body())

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise bad_request("chunked request bodies are not supported; send Content-Length")
        try:
            size = int(length or 0)
        except ValueError:
            raise bad_request(f"bad Content-Length {length!r}") from None
        if size > MAX_BODY_BYTES:
            self.close_connection = True
            raise bad_request(f"request body of {size} bytes is larger than {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(size) if size else b""
        if not raw.strip():
            raise bad_request("the request body is empty; expected a JSON object")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad_request(f"malformed JSON in the request body: {exc}") from None

    # --- routes ---

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        service = self.service
        if path == "/health":
            if service.engine.healthy():
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._send_error(ApiError(503, f"the lab engine is not healthy: {service.engine.problem()}",
                                          "ServiceUnavailableError"))
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{
                "id": service.model_name, "object": "model", "created": service.created, "owned_by": "memtel",
                "root": service.model_name, "parent": None, "max_model_len": service.max_model_len}]})
        elif path == "/version":
            from telemetry import __version__

            self._send_json(200, {"version": f"memtel-lab {__version__}", "lab": service.engine.describe()})
        elif path == "/metrics":
            data = generate_latest(service.metrics.registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._send_error(ApiError(404, f"no route for GET {path}", "NotFoundError"))

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        arrival = time.perf_counter()
        try:
            if path not in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/reset_prefix_cache",
                            "/lab/tenant"):
                self._drain()
                raise ApiError(404, f"no route for POST {path}", "NotFoundError")
            if path == "/reset_prefix_cache":
                self._drain()
                self.service.engine.reset_prefix_cache()
                self._send_json(200, {})
                return
            body = self._read_json()
            if path == "/tokenize":
                self._send_json(200, self.service.tokenize(body))
                return
            if path == "/lab/tenant":
                self._send_json(200, self.service.tenant(body))
                return
            request = self.service.parse_completion(body, chat=path == "/v1/chat/completions")
        except ApiError as error:
            self._send_error(error)
            return
        if request.stream:
            self._stream(request, arrival)
        else:
            self._complete(request, arrival)

    def _drain(self) -> None:
        try:
            size = min(int(self.headers.get("Content-Length") or 0), MAX_BODY_BYTES)
        except ValueError:
            size = 0
        if size:
            self.rfile.read(size)

    def _ids(self, request: CompletionRequest) -> tuple[str, str]:
        prefix = "chatcmpl" if request.chat else "cmpl"
        return f"{prefix}-{uuid.uuid4().hex}", "chat.completion" if request.chat else "text_completion"

    def _complete(self, request: CompletionRequest, arrival: float) -> None:
        request_id, kind = self._ids(request)
        try:
            texts, final = [], {}
            for event, data in self.service.run(request, arrival):
                if event == "token":
                    texts.append(data["text"])
                else:
                    final = data
        except ApiError as error:
            self._send_error(error)
            return
        text = "".join(texts)
        if request.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        self._send_json(200, {"id": request_id, "object": kind, "created": int(time.time()),
                              "model": request.model, "choices": [choice], "usage": final["usage"]})

    def _stream(self, request: CompletionRequest, arrival: float) -> None:
        request_id, _kind = self._ids(request)
        created = int(time.time())
        chunk_kind = "chat.completion.chunk" if request.chat else "text_completion"
        events = self.service.run(request, arrival)
        try:
            first = next(events)  # the prefill happens here; an error can still be a plain 400/500
        except ApiError as error:
            self._send_error(error)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(payload: Any) -> None:
            data = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def chunk(data: dict) -> dict:
            if request.chat:
                delta = {"content": data["text"]}
                if data["index"] == 0:
                    delta = {"role": "assistant", "content": data["text"]}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            else:
                choice = {"index": 0, "text": data["text"], "logprobs": None, "finish_reason": None,
                          "stop_reason": None}
            return {"id": request_id, "object": chunk_kind, "created": created, "model": request.model,
                    "choices": [choice]}

        try:
            pending = chunk(first[1])
            final: dict = {}
            for event, data in events:
                if event == "token":
                    send(pending)
                    pending = chunk(data)
                else:
                    final = data
            pending["choices"][0]["finish_reason"] = "length"  # the last token carries the finish reason
            send(pending)
            if request.include_usage:
                send({"id": request_id, "object": chunk_kind, "created": created, "model": request.model,
                      "choices": [], "usage": final.get("usage")})
            send(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-stream; nothing to tell it
        except ApiError as error:
            send({"object": "error", **error.body()})
            self.wfile.write(b"0\r\n\r\n")


def _number_in(value: Any, low: float, high: float, *, above_low: bool = False) -> float | None:
    """`value` as a float if it is a JSON number in [low, high] ((low, high] with `above_low`), else None. NaN and
    infinity fail the comparisons; an integer of 400 digits is compared exactly, never made a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not (low < value if above_low else low <= value) or not value <= high:
        return None
    return float(value)


class LabHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def make_server(service: LabService, host: str, port: int) -> LabHTTPServer:
    handler = type("BoundLabHandler", (LabHandler,), {"service": service})
    return LabHTTPServer((host, port), handler)
