"""GET from a test server on loopback with the standard library only (no httpx: the gpu tests run where only
memtel's core is installed)."""

from __future__ import annotations

import urllib.request

# Loopback only: never through a proxy named in the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get_text(url: str, timeout: float = 10.0) -> str:
    """The body of `url` as text; an HTTP error status raises urllib.error.HTTPError."""
    with _OPENER.open(url, timeout=timeout) as response:
        return response.read().decode("utf-8", errors="replace")


__all__ = ["get_text"]
