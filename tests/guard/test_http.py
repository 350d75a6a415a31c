"""HTTP/1.1 through h11 on both sides: lingering closes, read deadlines, upstreams that close or send garbage."""

from __future__ import annotations

import asyncio
import tracemalloc

import h11
import pytest

from telemetry.guard.http import Channel, ClientSide, ServerSide, UpstreamClosed, UpstreamError


def test_the_lingering_close_drains_what_the_client_sends_until_its_eof():
    channel = Channel()
    fed = []

    def feed(data: bytes | None) -> None:
        fed.append(data)
        channel.eof_received() if data is None else channel.data_received(data)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        feed(b"rest of a body")
        loop.call_later(0.01, feed, b"and more")
        loop.call_later(0.02, feed, None)
        await channel.discard(1 << 20, 2.0)

    asyncio.run(main())
    assert fed == [b"rest of a body", b"and more", None]   # it returned at the EOF, not at the first bytes


def test_a_request_read_with_no_time_left_is_a_timeout_even_with_bytes_waiting():
    channel = Channel()
    channel.data_received(b"POST /v1/completions HTTP/1.1\r\n")

    async def main() -> bytes:
        with pytest.raises(asyncio.TimeoutError):
            await ServerSide(channel, 16384)._read(0.0)
        return await channel.read(None)

    assert asyncio.run(main()) == b"POST /v1/completions HTTP/1.1\r\n"   # still unread


def upstream_answer(data: bytes) -> Exception:
    """What ClientSide.response raises when the upstream, sent a GET, answers `data` (maybe nothing) and closes."""
    channel = Channel()

    async def main() -> None:
        side = ClientSide(channel, 16384)
        side._frame(h11.Request(method="GET", target="/", headers=[("Host", "u")]), h11.EndOfMessage())  # sent
        if data:
            channel.data_received(data)
        channel.eof_received()
        await side.response(1.0)

    with pytest.raises(UpstreamError) as raised:
        asyncio.run(main())
    return raised.value


def test_an_upstream_that_closes_before_a_byte_is_closed_and_one_that_sends_garbage_is_malformed():
    closed = upstream_answer(b"")
    assert type(closed) is UpstreamClosed and str(closed) == "the connection closed without an answer"
    garbage = upstream_answer(b"NOT HTTP AT ALL\r\n\r\n")
    assert type(garbage) is UpstreamError and str(garbage).startswith("malformed answer: ")


def test_a_body_of_one_byte_chunks_is_joined_in_one_buffer_with_yields_to_the_event_loop():
    # Issue 41: 1-byte chunks took other clients to p50 0.87 s and the guard from 79 to 370 MiB (a part per chunk,
    # parsed without a yield).
    chunks = 20_000
    channel = Channel()
    channel.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n" +
                          b"1\r\nx\r\n" * chunks + b"0\r\n\r\n")
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def main() -> tuple[bytes, int]:
        side = ServerSide(channel, 16384)
        await side.next_request(5.0, 5.0, 5.0)
        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        tracemalloc.start()
        try:
            body = await side.read_body(1 << 20, 5.0, 5.0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            ticker.cancel()
        return body, peak

    body, peak = asyncio.run(main())
    assert body == b"x" * chunks
    assert ticks >= chunks // 256 // 2, ticks   # the loop ran between the chunks
    assert peak < 200_000, peak                 # a part per chunk held 20,000 objects (about 1 MB)
