"""Listen addresses: `HOST:PORT`, `[IPv6]:PORT` or `:PORT` (every interface), checked before anything binds."""

from __future__ import annotations

import ipaddress

from telemetry.errors import ConfigError
from telemetry.url import is_host

_EXAMPLES = "e.g. 0.0.0.0:9101, 127.0.0.1:9101, [::1]:9101 or node1.example:9101"


def parse_listen(text: object, where: str = "--listen") -> tuple[str, int]:
    """(host, port) from a listen address; ConfigError in one line otherwise. Port 0 picks a free port."""
    if not isinstance(text, str) or not text or not text.isascii() or not text.isprintable() or " " in text:
        raise ConfigError(f"{where}: {text!r} is not HOST:PORT ({_EXAMPLES})")
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or text[close + 1:close + 2] != ":":
            raise ConfigError(f"{where}: {text!r} is not [IPv6]:PORT (an IPv6 address in brackets, then :PORT; "
                              f"{_EXAMPLES})")
        host, port_text = text[1:close], text[close + 2:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{where}: {host!r} in {text!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigError(f"{where}: {text!r} is not HOST:PORT ({_EXAMPLES})")
        if ":" in host:
            raise ConfigError(f"{where}: {text!r}: an IPv6 address needs brackets, e.g. [::1]:9101")
        if "]" in host or "[" in host:
            raise ConfigError(f"{where}: {text!r} is not HOST:PORT ({_EXAMPLES})")
        if host and not is_host(host):   # (no IPv6 here: a colon in the host was refused above)
            raise ConfigError(f"{where}: {host!r} in {text!r} is neither an IP address nor a host name")
        host = host or "0.0.0.0"
    if not port_text.isdigit() or len(port_text) > 5 or int(port_text) > 65535:
        raise ConfigError(f"{where}: port {port_text!r} in {text!r} is not a number from 0 to 65535")
    return host, int(port_text)


def format_listen(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["format_listen", "parse_listen"]
