"""The live status line of `memtel ab run`: what the run is doing now, rendered by rich twice a second.

The run's parts (the block schedule, the server's lifecycle, one step) set its fields; nothing reads
them back but the renderer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from harness.ab.progress import RequestProgress

if TYPE_CHECKING:
    from rich.text import Text


@dataclasses.dataclass
class Status:
    """What the live status line shows; updated by the run, rendered by rich twice a second."""
    phase: str = "starting"
    arm: str = "-"
    repeat: int = 0
    step: str = "-"
    step_index: int = 0
    steps: int = 0
    tokens: int = 0
    step_started: float = 0.0
    last_ttft: float | None = None
    progress: RequestProgress | None = None  # the request in flight
    run_started: float = dataclasses.field(default_factory=time.monotonic)

    def render(self) -> Text:
        from rich.text import Text

        now = time.monotonic()
        progress = self.progress
        if progress is not None:
            during = progress.text()
        else:
            during = f"step {now - self.step_started if self.step_started else 0.0:,.0f} s"
        ttft = f"{self.last_ttft:.2f} s" if self.last_ttft is not None else "-"
        return Text.assemble(
            ("memtel ab ", "bold"), (f"{self.arm}", "cyan"), f" repeat {self.repeat} ",
            (f"{self.step}", "magenta"), f" ({self.step_index}/{self.steps}) ",
            f"{self.tokens:,} tokens · {self.phase} · {during} · run {now - self.run_started:,.0f} s",
            f" · last TTFT {ttft}",
        )


__all__ = ["Status"]
