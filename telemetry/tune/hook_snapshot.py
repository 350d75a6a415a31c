"""`memtel tune --hook URL`: a live hook's allocator state, read from its exporter's `/snapshot`.

The hook's exporter serves `torch.cuda.memory_snapshot()` of its rank (telemetry/hook/exporter.py). Whatever
answers on the port is read as untrusted, as `memtel forecast` reads a file: one deadline for the whole GET, the
body capped at `--max-file-gb` and parsed with the same object and block limits (`--max-objects`,
`--max-blocks`), every failure one line. The body is kept in a temporary file for `--verify`'s probes, which
read the state again in fresh processes.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from telemetry.errors import ConfigError, RunError

FETCH_SECONDS = 30.0
_STATUS_WHY = {
    403: "the hook serves its snapshot only on a loopback address or behind a login (give the user and password "
         "in the URL)",
    404: "no /snapshot here (a hook older than this memtel, or not a hook's exporter)",
    413: "the snapshot is larger than the hook serves",
    503: "the hooked process has no allocator snapshot yet (no hooked call has run on a CUDA device)",
}


def hook_endpoint(text: str) -> Any:
    """The /snapshot endpoint of the hook named by `text` (HOST:PORT, http(s)://[USER:PASSWORD@]HOST:PORT[/PATH];
    a bare host: the hook's default port; a /metrics path is taken to mean the same exporter)."""
    from telemetry.scrape.ports import HOOK_PORT
    from telemetry.url import METRICS_PATH, SNAPSHOT_PATH, parse_url

    endpoint = parse_url(text, "--hook", default_port=HOOK_PORT, default_path=SNAPSHOT_PATH)
    if endpoint.path in (METRICS_PATH, "/"):
        endpoint = dataclasses.replace(endpoint, path=SNAPSHOT_PATH)
    return endpoint


def fetch_snapshot(text: str, *, device: int | None, max_bytes: int, max_objects: int, max_blocks: int,
                   seconds: float = FETCH_SECONDS) -> tuple[Any, Path]:
    """(the AllocatorState, a temporary file holding the body) of the hook at `text` (`fetch_hook`)."""
    state, path, _ = fetch_hook(text, device=device, max_bytes=max_bytes, max_objects=max_objects,
                                max_blocks=max_blocks, seconds=seconds)
    return state, path


def fetch_hook(text: str, *, device: int | None, max_bytes: int, max_objects: int, max_blocks: int,
               seconds: float = FETCH_SECONDS) -> tuple[Any, Path, dict[str, Any] | None]:
    """(the AllocatorState, a temporary file holding the body, the live forecast's inputs where the hook serves
    them: `forecast_inputs`) of the hook at `text`; ConfigError (one line) for a bad URL or a body that is no
    snapshot within the limits, RunError (one line) when the hook cannot be read. The caller removes the file."""
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.allocsim.snapshot_file import parse_snapshot_bytes
    from telemetry.scrape.fetch import FetchError, get

    endpoint = hook_endpoint(text)
    try:
        body = get(endpoint, time.monotonic() + seconds, max_bytes)
    except FetchError as exc:
        message = str(exc)
        status = message[5:].strip() if message.startswith("HTTP ") else ""
        why = _STATUS_WHY.get(int(status)) if status.isdigit() else None
        raise RunError(f"--hook {endpoint.url}: {message}" + (f": {why}" if why else "")) from None
    doc = parse_snapshot_bytes(body, endpoint.url, max_bytes, max_objects)
    if device is None and isinstance(doc, dict) and isinstance(doc.get("device"), int):
        device = doc["device"]
    state = read_allocator_state(doc, device=device, source=endpoint.url, max_blocks=max_blocks)
    inputs = forecast_inputs(doc.get("forecast") if isinstance(doc, dict) else None, endpoint.url)
    handle, name = tempfile.mkstemp(prefix="memtel-tune-", suffix=".json")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(body)
    except OSError as exc:
        Path(name).unlink(missing_ok=True)
        raise ConfigError(f"--hook: cannot keep the snapshot in a temporary file: {exc.strerror or exc}") from None
    return state, Path(name), inputs


def forecast_inputs(raw: Any, source: str) -> dict[str, Any] | None:
    """The live forecast's inputs as /snapshot serves them (telemetry/hook/forecast/runner.py `tune_inputs`),
    checked: the shape an IndexerShape, the pattern a LaunchPattern, the settings parsed, the limit a byte count;
    None where the hook serves none. ConfigError (one line) for anything else."""
    from telemetry.model.allocsim.config import parse_alloc_conf
    from telemetry.model.indexer.prefill import LaunchPattern
    from telemetry.model.indexer.shape import IndexerShape

    if raw is None:
        return None

    def bad(what: str) -> ConfigError:
        return ConfigError(f"--hook {source}: the forecast it serves has {what}")

    if not isinstance(raw, dict):
        raise bad("no object")
    try:
        shape = IndexerShape(**raw["shape"])
        pattern = None if raw.get("pattern") is None else LaunchPattern(**raw["pattern"])
        conf = raw["alloc_conf"]
        limit, total, gauge = raw["limit_bytes"], raw.get("total_memory"), raw["max_fit_tokens"]
        mode, shared = raw["mode"], raw.get("shared", False)
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise bad(f"a missing or bad field ({exc})") from None
    if not isinstance(conf, str) or mode not in ("stock", "fixed") or not isinstance(shared, bool):
        raise bad("bad settings, width or sharing")
    for value in (limit, gauge, *(() if total is None else (total,))):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(f"a byte count or token count that is not a non-negative integer ({value!r})")
    parse_alloc_conf(conf)
    return {"shape": shape, "pattern": pattern or LaunchPattern(), "alloc_conf": conf, "limit_bytes": limit,
            "total_memory": total, "shared": shared, "mode": mode, "max_fit_tokens": gauge,
            "budget": str(raw.get("budget", ""))[:200], "taken_at": raw.get("taken_at")}


__all__ = ["FETCH_SECONDS", "fetch_hook", "fetch_snapshot", "forecast_inputs", "hook_endpoint"]
