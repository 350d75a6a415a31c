"""Where a held prompt waits, for every front door on asyncio (the guard's proxy, the LiteLLM gate, the Ray router).

The core (queue.py) keeps the waiters and their order and says, through `Admission.wake(now)`, which of them to
decide again. This module is the one asyncio side of that: one future per held prompt, set when its core wakes it;
`kick` when the limit may have risen (a hook answered, a hold was released, a replica came back) runs one pump on the
loop's next turn, however many kicks came before it. No I/O: the front door still reads, counts and forwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

from telemetry.admission.core import Admission, Now, Prompt


def now() -> Now:
    """The two clocks every decision takes, read once."""
    return Now(time.monotonic(), time.time())


class HeldPrompts:
    """The held prompts of one front door's cores (`cores()`: every Admission it decides with, read at each pump)."""

    def __init__(self, cores: Callable[[], Iterable[Admission]]) -> None:
        self._cores = cores
        self._woken: dict[Prompt, asyncio.Future[None]] = {}
        self._scheduled = False

    @property
    def waiting(self) -> int:
        return len(self._woken)

    def kick(self) -> None:
        """The limit may have risen: pump once on the running loop's next turn (many kicks, one pump)."""
        if self._woken and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.pump)

    def pump(self) -> None:
        """Wake every prompt a core names now."""
        self._scheduled = False
        at = now()
        for core in self._cores():
            for prompt in core.wake(at) if core.line.waiters else ():
                woken = self._woken.get(prompt)
                if woken is not None and not woken.done():
                    woken.set_result(None)

    async def wait(self, prompt: Prompt, deadline: float, gone: Awaitable[object] | None = None) -> bool:
        """Wait until the core wakes `prompt` or `deadline` (monotonic) passes: True, decide it again. False: `gone`
        (the client's leaving) came first; the caller takes the prompt out of its core (`Admission.leave`)."""
        woken = self._woken[prompt] = asyncio.get_running_loop().create_future()
        leaving = None if gone is None else asyncio.ensure_future(gone)
        try:
            self.kick()  # it may fit already (a hold was released between its refusal and now)
            left = deadline - time.monotonic()
            if left > 0:
                await asyncio.wait((woken,) if leaving is None else (woken, leaving), timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
            return leaving is None or not leaving.done()
        finally:
            del self._woken[prompt]
            if leaving is not None and leaving is not gone and not leaving.done():
                leaving.cancel()


__all__ = ["HeldPrompts", "now"]
