"""The one parser of the URLs memtel reads from: a /metrics endpoint (a daemon's, a hook's) or an engine's base
URL. Accepted: `HOST:PORT`, `[IPv6]:PORT`, `HOST` (where the caller has a default port), and
`http(s)://[USER:PASSWORD@]HOST[:PORT][/PATH]`; an empty path is `/metrics` unless the caller says otherwise.
An engine's base URL (`parse_base_url`: the guard's `--upstream`) is the same without a path, a query or
credentials: the engine's paths are the caller's. Anything else is a `ConfigError` of one line saying what was
wrong and what is expected.
"""

from __future__ import annotations

import base64
import ipaddress
import re
import urllib.parse
from dataclasses import dataclass

from telemetry.errors import ConfigError, shown

METRICS_PATH = "/metrics"
_SCHEME_PORTS = {"http": 80, "https": 443}
# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")
_EXPECTED = "expected HOST:PORT or http(s)://HOST:PORT[/PATH] (an IPv6 address in brackets: [::1]:9200)"
_EXPECTED_BASE = ("expected the engine's base URL, e.g. http://127.0.0.1:8000 or 127.0.0.1:8000 (an IPv6 address in "
                  "brackets: [::1]:8000)")


@dataclass(frozen=True)
class Endpoint:
    """A parsed URL. `url` names it (in tables, logs, refusals) and never carries the credentials."""

    scheme: str  # http or https
    host: str  # an IPv6 address without its brackets
    port: int
    path: str  # with its query, if any
    authorization: str | None = None  # the Authorization header for credentials in the URL

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def host_port(self) -> str:
        """`host:port`, `[v6]:port`: the Host header and the URL's authority."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def base(self) -> str:
        return f"{self.scheme}://{self.host_port}"

    @property
    def url(self) -> str:
        return self.base + self.path

    def at(self, port: int, path: str = METRICS_PATH) -> Endpoint:
        """The same host (and scheme) on another port and path: a hook's exporter beside its node's daemon."""
        return Endpoint(self.scheme, self.host, port, path)


def _at(where: str) -> str:
    return f"{where}: " if where else ""   # argparse names the flag itself


def _host_ok(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(_HOST_NAME.fullmatch(host))
    return True


def parse_url(text: str, where: str = "URL", *, default_port: int | None = None,
              default_path: str = METRICS_PATH) -> Endpoint:
    """The endpoint `text` names; ConfigError (one line, starting with `where` if given) for anything else.
    Without a port, a URL with a scheme gets the scheme's (80, 443) and a bare host `default_port` (an error where
    None)."""
    what = "a metrics URL" if default_path == METRICS_PATH else "a URL"
    return _parse(text, where, default_port, default_path, what, _EXPECTED)


def parse_base_url(text: str, where: str = "URL", *, default_port: int | None = None) -> Endpoint:
    """An engine's base URL (its `path` is empty): as `parse_url`, but a path other than `/`, a query or
    credentials are refused, since the caller adds the engine's paths and sends the client's headers."""
    endpoint = _parse(text, where, default_port, "", "a base URL", _EXPECTED_BASE)
    if endpoint.path or endpoint.authorization is not None:
        extra = "credentials" if endpoint.authorization is not None else f"the path {endpoint.path[:40]!r}"
        # (the URL without its credentials: a refusal never echoes a password)
        raise ConfigError(f"{_at(where)}{shown(endpoint.url)} is not a base URL (it has {extra}); {_EXPECTED_BASE}")
    return endpoint


def _parse(text: str, where: str, default_port: int | None, default_path: str, what: str,
           expected: str) -> Endpoint:
    if not isinstance(text, str):
        raise ConfigError(f"{_at(where)}{shown(text)} is not a URL; {expected}")
    value = text.strip()
    if not value:
        raise ConfigError(f"{_at(where)}an empty URL; {expected}")
    has_scheme = "://" in value
    if not has_scheme:
        if value.count(":") > 1 and not value.startswith("["):
            raise ConfigError(f"{_at(where)}{shown(text)}: an IPv6 address needs brackets, e.g. [::1]:9200")
        value = "http://" + value
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port
    except ValueError:   # a port that is no number from 0 to 65535, brackets that do not close
        raise ConfigError(f"{_at(where)}{shown(text)} has no valid host and port; {expected}") from None
    host = parts.hostname or ""
    if parts.scheme not in _SCHEME_PORTS or not host or not _host_ok(host):
        raise ConfigError(f"{_at(where)}{shown(text)} is not {what}; {expected}")
    if port == 0:
        raise ConfigError(f"{_at(where)}{shown(text)}: port 0; expected a port from 1 to 65535")
    if port is None:
        if not has_scheme and default_port is None:
            raise ConfigError(f"{_at(where)}{shown(text)} has no port; {expected}")
        port = _SCHEME_PORTS[parts.scheme] if has_scheme or default_port is None else default_port
    authorization = None
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    path = parts.path if parts.path not in ("", "/") else default_path
    if parts.query:
        path += "?" + parts.query
    return Endpoint(parts.scheme, host, port, path, authorization)


def parse_url_list(text: str, where: str = "URL", *, default_port: int | None = None) -> list[Endpoint]:
    """Comma-separated URLs (empty items are skipped); ConfigError for none or for a bad one."""
    endpoints = [parse_url(part, where, default_port=default_port) for part in text.split(",") if part.strip()]
    if not endpoints:
        raise ConfigError(f"{_at(where)}{shown(text)} names no URL; expected URL[,URL...]")
    return endpoints


__all__ = ["METRICS_PATH", "Endpoint", "parse_base_url", "parse_url", "parse_url_list"]
