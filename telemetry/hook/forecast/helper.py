"""The forecast's helper process: the simulation runs there, never under the serving process's GIL.

The hook's forecast thread (runner.py) keeps only the allocator snapshot in the serving process. It sends the
snapshot to one helper process per serving process (`python -m telemetry.hook.forecast.helper`, started at the
first cycle, stdin/stdout pipes): the native reader's bytes as they are, in one frame (`"snapshot": "bytes"` in
the request; the helper decodes them, snapshot_native/codec.py), or torch's segments in batches of
`BATCH_SEGMENTS`, encoded with `marshal` a batch at a time with a pause between batches (the serving thread
gets the GIL back after each); then it waits for the answer: waiting on a pipe holds no GIL. The helper reads
the segments, simulates (compute.py) and answers with the forecasts, the fit budget and the longest prefill
that fits, and the CPU seconds it spent.

Frames: a 4-byte big-endian length, then a marshal of plain data (ints, strings, lists, dicts) or the snapshot's
bytes; the pipes are private to the two processes. Message sizes are bounded (`MAX_FRAME_BYTES`). The helper
exits when its stdin closes (the serving process is gone, or `close()`); it imports neither torch nor the
serving program.
"""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from telemetry import hook_env

BATCH_SEGMENTS = 64
HELPER_MAIN = "import sys; from telemetry.hook.forecast.helper import main; sys.exit(main())"
MAX_FRAME_BYTES = 1 << 30
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ShadowInput:
    """The event shadow's input for one cycle (shadow.py): the allocator's events since the last cycle, after a
    full native snapshot where the shadow starts (again). `options`: the replay's settings (plain data)."""

    events: bytes
    snapshot: bytes | None = None
    options: dict[str, Any] = field(default_factory=dict)


class HelperError(RuntimeError):
    """The helper process could not be started, died or answered out of protocol."""


def write_frame(stream: IO[bytes], data: bytes) -> None:
    if len(data) > MAX_FRAME_BYTES:
        raise HelperError(f"a forecast message of {len(data):,} bytes is over the {MAX_FRAME_BYTES:,}-byte bound")
    stream.write(len(data).to_bytes(4, "big"))
    stream.write(data)   # not joined: a snapshot's bytes are not copied again


def read_frame(stream: IO[bytes]) -> bytes | None:
    """One frame's bytes; None at a clean end of the stream."""
    head = stream.read(4)
    if not head:
        return None
    if len(head) < 4:
        raise HelperError("the forecast pipe ended inside a frame header")
    size = int.from_bytes(head, "big")
    if size > MAX_FRAME_BYTES:
        raise HelperError(f"a forecast frame of {size:,} bytes is over the {MAX_FRAME_BYTES:,}-byte bound")
    data = stream.read(size)
    if len(data) < size:
        raise HelperError("the forecast pipe ended inside a frame")
    return data


class ForecastHelper:
    """The serving side: starts the helper on first use, sends a cycle, returns its answer (plain data)."""

    def __init__(self, *, command: list[str] | None = None) -> None:
        self.command = command or [sys.executable, "-c", HELPER_MAIN]
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.starts = 0

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None else process.pid

    def _start(self) -> subprocess.Popen[bytes]:
        process = self._process
        if process is not None and process.poll() is None:
            return process
        self.starts += 1
        env = dict(os.environ)
        for name in (hook_env.TARGETS, hook_env.ENABLE):   # not a serving process: memtel run's bootstrap stays off
            env.pop(name, None)
        # The helper imports memtel from where this process did (a checkout on sys.path, an installed package).
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=None, close_fds=True, env=env)
        except OSError as error:
            raise HelperError(f"cannot start the forecast helper ({' '.join(self.command)}): {error}") from None
        self._process = process
        weakref.finalize(self, _end, process, 0.5)   # a helper whose owner is gone ends with it (pipes closed)
        return process

    def cycle(self, request: dict[str, Any], segments: list[Any] | bytes | ShadowInput,
              pause: Callable[[], None]) -> dict[str, Any]:
        """Send one cycle (the request, then the native snapshot's bytes, the event shadow's input, or the segments
        in batches) and wait for the answer."""
        with self._lock:
            process = self._start()
            assert process.stdin is not None and process.stdout is not None
            native = isinstance(segments, bytes)
            batches = [segments[i:i + BATCH_SEGMENTS] for i in range(0, len(segments), BATCH_SEGMENTS)] \
                if isinstance(segments, list) else []
            kind = "bytes" if native else "segments"
            if isinstance(segments, ShadowInput):
                kind = "events" if segments.snapshot is None else "bytes"
            try:
                write_frame(process.stdin, marshal.dumps({**request, "batches": len(batches), "snapshot": kind,
                                                          "shadow": segments.options if isinstance(
                                                              segments, ShadowInput) else None}))
                if isinstance(segments, bytes):
                    write_frame(process.stdin, segments)
                elif isinstance(segments, ShadowInput):
                    if segments.snapshot is not None:
                        write_frame(process.stdin, segments.snapshot)
                    write_frame(process.stdin, segments.events)
                for batch in batches:
                    write_frame(process.stdin, marshal.dumps(batch))
                    pause()
                process.stdin.flush()
                data = read_frame(process.stdout)
            except (OSError, ValueError) as error:
                self._kill()
                raise HelperError(f"the forecast helper (pid {process.pid}) is gone: {error}") from None
            if data is None:
                code = process.wait(5)
                self._process = None
                raise HelperError(f"the forecast helper (pid {process.pid}) exited with {code}")
            try:
                answer = marshal.loads(data)
            except (EOFError, ValueError, TypeError) as error:
                self._kill()
                raise HelperError(f"the forecast helper answered out of protocol: {error}") from None
            if not isinstance(answer, dict):
                self._kill()
                raise HelperError("the forecast helper answered out of protocol")
            return answer

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            _end(process, 0.0)

    def close(self, timeout: float = 2.0) -> None:
        """End the helper: its stdin closes and it exits; killed if it does not within `timeout`."""
        process, self._process = self._process, None
        if process is not None:
            _end(process, timeout)

    def forget_after_fork(self) -> None:
        """A forked child has no helper of its own: it starts one at its first cycle (the parent's stays its own)."""
        self._process = None
        self._lock = threading.Lock()


def _end(process: subprocess.Popen[bytes], timeout: float = 2.0) -> None:
    """Close the helper's pipes (it exits at the end of its stdin), kill it if it has not within `timeout`."""
    for stream in (process.stdin, process.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


# ---- the helper process ----------------------------------------------------------------------------------------

def serve(stdin: IO[bytes], stdout: IO[bytes]) -> int:
    """Answer cycles until stdin ends."""
    from telemetry.errors import ConfigError
    from telemetry.hook.forecast.compute import decode_request, encode_output, run_cycle
    from telemetry.hook.forecast.snapshot_native.codec import SnapshotBytesError

    shadow: Any = None   # the event shadow (shadow.py) this helper keeps between cycles, if any
    while True:
        head = read_frame(stdin)
        if head is None:
            return 0
        request = marshal.loads(head)
        segments: list[Any] | bytes | None = []
        events: bytes | None = None
        if request.get("snapshot") == "bytes":
            data = read_frame(stdin)
            if data is None:
                return 0
            segments = data
        if request.get("shadow") is not None:
            events = read_frame(stdin)
            if events is None:
                return 0
        for _ in range(int(request["batches"])):
            batch = read_frame(stdin)
            if batch is None:
                return 0
            assert isinstance(segments, list)
            segments.extend(marshal.loads(batch))
        cpu = time.process_time()
        answer: dict[str, Any] = {}
        try:
            device, workload, conf, tokens, base = decode_request(request)
            if events is not None:
                current, shadow = shadow, None   # a step that raises leaves no shadow behind
                shadow, segments, answer["shadow"] = follow(current, request, segments or [], events)
            if segments is None:
                answer["error"] = "shadow"
            else:
                answer["ok"] = encode_output(run_cycle(segments, device, workload, conf, tokens, base))
        except SnapshotBytesError as error:   # the native snapshot's bytes are not its format
            answer.update(error="snapshot", message=str(error))
        except ConfigError as error:   # SnapshotError: a state the simulator does not model
            answer.update(error="unsupported_state", message=str(error))
        except Exception as error:
            answer.update(error="simulation", message=f"{type(error).__name__}: {error}")
        answer["cpu_seconds"] = time.process_time() - cpu
        write_frame(stdout, marshal.dumps(answer))
        stdout.flush()


def follow(shadow: Any, request: dict[str, Any], segments: list[Any] | bytes | None,
           events: bytes) -> tuple[Any, list[Any] | bytes | None, list[Any]]:
    """The event shadow's step: (the shadow kept, the segments to forecast from (None: lost, take a full snapshot),
    [True] or [False, reason, message]). A full snapshot's bytes seed a new shadow (the events after its marker
    replayed on it; the forecast uses the snapshot itself); events alone move the kept one."""
    from telemetry.hook.forecast.shadow import LOST, OVERFLOW, POOL, Shadow, ShadowLost, after_marker
    from telemetry.hook.forecast.snapshot_native.codec import decode_snapshot
    from telemetry.hook.forecast.snapshot_native.events import decode_events

    options = request["shadow"]
    log = decode_events(events)   # EventBytesError: a SnapshotBytesError, answered as a failed snapshot
    try:
        if log.overflowed:
            raise ShadowLost(OVERFLOW, "the event log dropped events since the last cycle")
        if log.no_pool:
            raise ShadowLost(POOL, "this torch's trace events name no memory pool")
        if isinstance(segments, bytes):
            decoded = decode_snapshot(segments)
            shadow = None
            fresh = Shadow(decoded, int(options["device"]), str(options["conf"]), options.get("total_memory"))
            fresh.apply(after_marker(log.events, int(options["device"])))
            return fresh, decoded, [True]
        if shadow is None or shadow.device != options["device"]:
            raise ShadowLost(LOST, "this helper holds no shadow of that device (it started again)")
        shadow.apply(log.events)
        return shadow, shadow.segments(), [True]
    except ShadowLost as lost:
        kept = decode_snapshot(segments) if isinstance(segments, bytes) else None
        return None, kept, [False, lost.reason, lost.message[:300]]


def main() -> int:
    try:
        return serve(sys.stdin.buffer, sys.stdout.buffer)
    except (BrokenPipeError, KeyboardInterrupt):
        return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["BATCH_SEGMENTS", "ForecastHelper", "HelperError", "ShadowInput", "follow", "read_frame", "serve",
           "write_frame"]
