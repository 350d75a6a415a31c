"""The hook's HTTP exporter: the one place that turns the hook's registry into a listening /metrics.

It serves through memtel's shared exporter server (telemetry/exporter: idle timeout, bounded
connections, large backlog, optional TLS and basic auth from a web config file), so idle connections
or a connection flood cannot take threads or descriptors from the serving process. Imported only when
a process starts recording: a process that never records never listens.

`/snapshot` serves this rank's allocator state for `memtel tune --hook`: `torch.cuda.memory_snapshot()`
(without torch's trace) read through the hook's allocator reader, as the live forecast reads it,
on the exporter's thread when asked, never on the hooked call's path. JSON, `{"device": N, "segments":
[...]}`, each block without its stack frames; with the process's allocation history where the hook keeps one
(telemetry/hook/forecast/history.py: one the program keeps with `keep_history`, or torch's recorder under
MEMTEL_HOOK_HISTORY=1), `"history": [["a", id, bytes], ["f", id],
...]`, else `"history_lost"`: why not; with the live forecast's last fit, `"forecast"`: its workload, settings,
fit budget and gauge (published.py). Served only where no one else can ask for it unseen: an exporter listening
on a loopback address, or one whose web config asks for a login (the other routes' basic
auth applies first); elsewhere 403. At most `MAX_SNAPSHOT_BLOCKS` segments and blocks (413 beyond); 503 with
one line where the process has no allocator snapshot (no CUDA device bound by a hooked call, no allocator
source with a snapshot).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client.registry import CollectorRegistry

from telemetry.limits import MAX_SNAPSHOT_BLOCKS
from telemetry.url import SNAPSHOT_PATH

log = logging.getLogger("memtel.hook")

SnapshotProvider = Callable[[], "tuple[Any, int | None] | None"]
_TEXT = "text/plain; charset=utf-8"
_DROPPED_BLOCK_KEYS = ("frames", "history")


class ExporterHandle(Protocol):
    port: int

    @property
    def url(self) -> str: ...   # "https://host:port" under a web config with TLS, else "http://host:port"

    def stop(self) -> None: ...

    def close_after_fork(self) -> None: ...


def reader_snapshot() -> tuple[Any, int | None] | None:
    """The hook's allocator reader's snapshot: (segments, device index), or None where it has none."""
    from telemetry.hook.allocator import current_reader

    return current_reader().snapshot()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def snapshot_answer(provider: SnapshotProvider, *, max_blocks: int = MAX_SNAPSHOT_BLOCKS) -> tuple[int, bytes, str]:
    """(status, body, content type) of a /snapshot request: the provider's segments as JSON, or one line."""
    try:
        taken = provider()
    except Exception as exc:   # a failing allocator read must not take the exporter down
        log.warning("memtel: reading the allocator snapshot failed: %s: %s", type(exc).__name__, exc)
        return 500, f"reading the allocator snapshot failed: {type(exc).__name__}\n".encode(), _TEXT
    if taken is None:
        return 503, (b"no allocator snapshot in this process: no CUDA device bound yet (no hooked call ran on a "
                     b"GPU) and no allocator source with a snapshot\n"), _TEXT
    segments, device = taken
    extra = _history(device)
    if not isinstance(segments, list):
        return 500, b"the allocator snapshot is not a list of segments\n", _TEXT
    count = len(segments) + sum(len(s.get("blocks", ())) for s in segments if isinstance(s, dict))
    if count > max_blocks:
        return 413, (f"the allocator snapshot has {count:,} segments and blocks, over the {max_blocks:,} this "
                     f"exporter serves\n").encode(), _TEXT
    slim = [{**s, "blocks": [{k: v for k, v in b.items() if k not in _DROPPED_BLOCK_KEYS}
                             for b in s.get("blocks", ()) if isinstance(b, dict)]}
            if isinstance(s, dict) else s for s in segments]
    from telemetry.hook.forecast.published import published

    forecast = published()
    if forecast is not None:   # the live forecast's last fit: its workload, settings, budget and gauge
        extra["forecast"] = forecast
    return 200, json.dumps({"device": device, "segments": slim, **extra}).encode(), "application/json"


def _history(device: int | None) -> dict[str, Any]:
    """The process's allocation history: the one the program keeps (`keep_history`), else the CUDA allocator's,
    compacted, where MEMTEL_HOOK_HISTORY=1 turned torch's recorder on; {} where there is none."""
    from telemetry.hook.forecast.history import kept_history, recording_asked, torch_history

    kept = kept_history()
    if kept is not None:
        ops = kept.ops()
        return {"history": ops} if ops is not None else {"history_lost": kept.lost}
    if device is None or not recording_asked():
        return {}
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    ops, lost = torch_history(torch, device)
    return {"history": ops} if ops is not None else {"history_lost": lost}


@functools.cache
def hook_exporter_class() -> type[Any]:
    """The shared exporter server with the hook's `/snapshot` route (module docstring); built on first use, so a
    process that never records never imports the server."""
    from telemetry.exporter import MetricsServer

    class HookExporter(MetricsServer):
        def __init__(self, *args: Any, snapshot: SnapshotProvider = reader_snapshot, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.snapshot_provider = snapshot

        @property
        def serves_snapshot(self) -> bool:
            """Only on a loopback address or behind a login (module docstring)."""
            return _loopback(self.host) or self.web_config.basic_auth is not None

        def _route(self, path: str, arrived: float) -> tuple[int, bytes, str]:
            if path != SNAPSHOT_PATH:
                return super()._route(path, arrived)
            if not self.serves_snapshot:
                return 403, (b"the allocator snapshot is served only on a loopback address or behind a login (a "
                             b"web config with basic_auth_users)\n"), _TEXT
            return snapshot_answer(self.snapshot_provider)

    return HookExporter


def start_exporter(registry: CollectorRegistry, host: str, port: int, web_config: str | None = None, *,
                   snapshot: SnapshotProvider = reader_snapshot) -> ExporterHandle:
    """Serve `registry` on host:port (web config file `web_config`: TLS and basic auth, or None for plain HTTP),
    and the allocator state from `snapshot()` on /snapshot.

    Raises MemtelError (ConfigError for a bad address or web config, ListenError for a taken port) or
    OSError; the caller counts and logs it.
    """
    from telemetry.exporter import load_web_config

    server = hook_exporter_class()(host, port, registry, web_config=load_web_config(web_config),
                                   name="memtel-hook", snapshot=snapshot)
    server.start()
    return server  # type: ignore[no-any-return]


__all__ = ["SNAPSHOT_PATH", "ExporterHandle", "hook_exporter_class", "reader_snapshot", "snapshot_answer",
           "start_exporter"]
