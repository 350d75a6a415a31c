"""What a hooked process of a test program does once it has made its calls: says who it is, waits to be scraped.

It writes `ready-<pid>.json` (pid, its exporter's port, rank, calls) into the handshake directory and waits
until the test creates `go` there (bounded), so the test can scrape every live exporter first.
"""

import json
import os
import time
from pathlib import Path


def report_and_wait(handshake: str, calls: int, timeout: float = 120.0, extra: dict | None = None) -> None:
    from telemetry.hook import active_handle

    handle = active_handle()
    rank = handle.state.rank if handle is not None else None
    info = {"pid": os.getpid(), "calls": calls, "port": handle.exporter_port if handle is not None else None,
            "rank": rank.rank if rank is not None else None, "source": rank.source if rank is not None else None,
            **(extra or {})}
    directory = Path(handshake)
    temporary = directory / f".ready-{os.getpid()}.tmp"
    temporary.write_text(json.dumps(info))
    temporary.rename(directory / f"ready-{os.getpid()}.json")
    deadline = time.monotonic() + timeout
    while not (directory / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
