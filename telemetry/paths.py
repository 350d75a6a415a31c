"""Where memtel keeps its files by default: one answer for the daemon and every tool that reads its state."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """The daemon's state directory (kernel-log state, flight ring).

    systemd's StateDirectory= sets STATE_DIRECTORY; root uses /var/lib; anyone else their XDG state dir.
    """
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/memtel")
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "memtel"
