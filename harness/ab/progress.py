"""What the console shows while a request runs: elapsed time, what the last step's rate predicts, and the
hook's calls so far.

A server streams nothing during a prefill (the first token is the first thing it sends), so there is no
true progress figure for a request in flight. What is shown, and what it is:

- elapsed: wall time since the request was sent;
- expected: the step's prompt tokens at the tokens/s of the block's previous request (its prompt tokens
  over its TTFT). A prefill's cost per token grows with the context (attention), so this is a lower bound:
  "at least";
- hook calls: the increase of `memtel_hook_calls_total` on the ranks' exporters since the request began
  (scraped every few seconds), a sign of life from inside the prefill, when the ladder names ranks.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from harness.ab.samplers import Scraper

SCRAPE_INTERVAL_S = 2.0
LOG_INTERVAL_S = 30.0  # a progress line in the console log this often while a request runs


@dataclass(frozen=True)
class Rate:
    """The tokens/s of a finished request: its prompt tokens over its TTFT."""

    step: str
    tokens_per_s: float


class RequestProgress:
    """Watches one request from another thread; `text()` is safe to call at any time."""

    def __init__(self, tokens: int, rate: Rate | None, ranks: dict[str, str],
                 interval_s: float = SCRAPE_INTERVAL_S) -> None:
        self.tokens = tokens
        self.rate = rate
        self.ranks = dict(ranks)
        self.interval_s = interval_s
        self.started = time.monotonic()
        self._calls_at_start: float | None = None
        self._calls: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RequestProgress:
        self.started = time.monotonic()
        if self.ranks:
            self._thread = threading.Thread(target=self._loop, name="memtel-request-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        scraper = Scraper(timeout_s=min(5.0, self.interval_s))
        try:
            while True:
                total = 0.0
                known = False
                for url in self.ranks.values():
                    calls = scraper.rank(url).hook_calls_total
                    if calls is not None:
                        total += calls
                        known = True
                if known:
                    if self._calls_at_start is None:
                        self._calls_at_start = total
                    self._calls = total
                if self._stop.wait(self.interval_s):
                    break
        finally:
            scraper.close()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def expected_s(self) -> float | None:
        """At least this long, at the previous request's rate (None: no previous request in this block)."""
        if self.rate is None or self.rate.tokens_per_s <= 0:
            return None
        return self.tokens / self.rate.tokens_per_s

    @property
    def hook_calls(self) -> int | None:
        """Hooked calls on the ranks since the request began (None: no rank answered)."""
        if self._calls is None or self._calls_at_start is None:
            return None
        return int(self._calls - self._calls_at_start)

    def text(self) -> str:
        elapsed = self.elapsed_s
        parts = [f"request {elapsed:,.0f} s"]
        expected = self.expected_s
        if expected is not None and self.rate is not None:
            parts.append(f"expected ≥ {expected:,.0f} s at {self.rate.step}'s {self.rate.tokens_per_s:,.0f} tokens/s")
        calls = self.hook_calls
        if calls is not None:
            per_s = calls / elapsed if elapsed > 0 else 0.0
            parts.append(f"hook calls +{calls:,} ({per_s:,.0f}/s)")
        return " · ".join(parts)


__all__ = ["LOG_INTERVAL_S", "Rate", "RequestProgress"]
