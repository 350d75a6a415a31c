"""The guard's upstream client: a forwarded request whose client leaves is cancelled upstream."""

from __future__ import annotations

import json
import socket
import threading

from tests.guard.servers import StubHook, exposition


def test_a_client_that_leaves_a_non_streamed_completion_closes_its_upstream_request_and_frees_its_hold(
        start_guard, upstream):
    # Issue 41: a client that left a non-streamed completion kept vLLM generating (the answer's head comes at its
    # end, and nothing was read meanwhile) and the guard holding its tokens.
    hook = StubHook(lambda: exposition(100_000))
    upstream.hold = threading.Event()
    try:
        guard = start_guard([hook.url])
        body = json.dumps({"model": "m", "prompt": "w " * 100}).encode()
        with socket.create_connection(("127.0.0.1", guard.port), timeout=5) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            guard.wait_for(lambda: "/v1/completions" in upstream.paths() and guard.tracker.in_prefill_tokens > 0)
        guard.wait_for(lambda: upstream.aborted == 1)            # the upstream saw its connection close
        guard.wait_for(lambda: guard.tracker.in_prefill_tokens == 0)   # the hold book is empty
        assert guard.sample("memtel_guard_in_prefill_tokens") == 0
    finally:
        upstream.hold.set()
        hook.stop()
