"""memtel's one URL parser, for every URL it reads from or sends to: a /metrics endpoint (a daemon's, a hook's),
an engine's base URL, a ladder's URLs. Accepted: `HOST:PORT`, `[IPv6]:PORT`, `HOST` (where the caller has a
default port), and `http(s)://[USER:PASSWORD@]HOST[:PORT][/PATH]`; an empty path is `/metrics` unless the caller
says otherwise. An engine's base URL (`parse_base_url`: the guard's `--upstream`) is the same without a path, a
query or credentials: the engine's paths are the caller's. A URL a config file writes (`parse_http_url`: a
ladder's, through telemetry/validate.py) names its scheme. Anything else is a `ConfigError` of one line saying
what was wrong and what is expected, which never quotes a password (`redact_credentials`, which the harness's
redactor uses too). No other module of memtel splits a URL itself (tests/test_url.py checks).
"""

from __future__ import annotations

import base64
import ipaddress
import re
import urllib.parse
from dataclasses import dataclass, field

from telemetry.errors import ConfigError, shown

METRICS_PATH = "/metrics"
SNAPSHOT_PATH = "/snapshot"  # the hook's allocator snapshot (telemetry/hook/exporter.py, memtel tune --hook)
_SCHEME_PORTS = {"http": 80, "https": 443}
# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")
_EXPECTED = "expected HOST:PORT or http(s)://HOST:PORT[/PATH] (an IPv6 address in brackets: [::1]:9200)"
_EXPECTED_BASE = ("expected the engine's base URL, e.g. http://127.0.0.1:8000 or 127.0.0.1:8000 (an IPv6 address in "
                  "brackets: [::1]:8000)")
_EXPECTED_HTTP = "expected an http(s) URL such as http://127.0.0.1:8000"
REDACTED = "***"  # what a URL's credentials are written as wherever they would be shown
_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#@\s\"'<>]+@")


@dataclass(frozen=True)
class Endpoint:
    """A parsed URL. `url` and `base` name it (in tables, logs, refusals) and never carry the credentials."""

    scheme: str  # http or https
    host: str  # an IPv6 address without its brackets
    port: int
    path: str  # with its query, if any
    # `user:password` (or a token) as the URL wrote it, percent-escapes and all; out of the repr (a log line)
    userinfo: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def authorization(self) -> str | None:
        """The Authorization header (basic) for the URL's credentials, None without any."""
        if self.userinfo is None:
            return None
        user, _, password = self.userinfo.partition(":")
        pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        return "Basic " + base64.b64encode(pair.encode()).decode()

    @property
    def host_port(self) -> str:
        """`host:port`, `[v6]:port`: the Host header and the URL's authority."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def base(self) -> str:
        return f"{self.scheme}://{self.host_port}"

    @property
    def base_with_credentials(self) -> str:
        """`base` with the credentials as written, for a client that sends them (httpx): never to be shown."""
        return self.base if self.userinfo is None else f"{self.scheme}://{self.userinfo}@{self.host_port}"

    @property
    def url(self) -> str:
        return self.base + self.path

    def at(self, port: int, path: str = METRICS_PATH) -> Endpoint:
        """The same host (and scheme) on another port and path: a hook's exporter beside its node's daemon."""
        return Endpoint(self.scheme, self.host, port, path)


def _at(where: str) -> str:
    return f"{where}: " if where else ""   # argparse names the flag itself


def redact_credentials(text: str) -> str:
    """`text` (a URL, or any text quoting URLs) with every `scheme://userinfo@` written `scheme://***@`."""
    return _CREDENTIALS.sub(lambda m: m.group(1) + REDACTED + "@", text)


# A refused URL written without its scheme can still start with credentials: `user:password@host:port`.
_LEADING_CREDENTIALS = re.compile(r"^[^/?#@\s\"'<>]+@")


def _shown(text: object) -> str:
    if not isinstance(text, str):
        return shown(text)
    return shown(_LEADING_CREDENTIALS.sub(REDACTED + "@", redact_credentials(text)))


def is_host(host: str) -> bool:
    """An IP address or an RFC 1123 host name (the listen addresses of telemetry/exporter/address.py too)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(_HOST_NAME.fullmatch(host))
    return True


class _Refused(Exception):
    """Why a text is no URL of the kind asked for, as a clause after the quoted text (`has no port`); `expected`
    replaces the caller's "expected ..." where the problem has its own."""

    def __init__(self, problem: str, expected: str | None = None) -> None:
        super().__init__(problem)
        self.problem, self.expected = problem, expected


def _refusal(refused: _Refused, text: object, where: str, expected: str) -> ConfigError:
    """A command line's or a replica file's wording: `--hooks: 'vm' has no port; expected HOST:PORT ...`."""
    return ConfigError(f"{_at(where)}{_shown(text)} {refused.problem}; {refused.expected or expected}")


def parse_url(text: str, where: str = "URL", *, default_port: int | None = None,
              default_path: str = METRICS_PATH) -> Endpoint:
    """The endpoint `text` names; ConfigError (one line, starting with `where` if given) for anything else.
    Without a port, a URL with a scheme gets the scheme's (80, 443) and a bare host `default_port` (an error where
    None)."""
    what = "a metrics URL" if default_path == METRICS_PATH else "a URL"
    try:
        return _parse(text, default_port, default_path, what)
    except _Refused as refused:
        raise _refusal(refused, text, where, _EXPECTED) from None


def parse_base_url(text: str, where: str = "URL", *, default_port: int | None = None) -> Endpoint:
    """An engine's base URL (its `path` is empty): as `parse_url`, but a path other than `/`, a query or
    credentials are refused, since the caller adds the engine's paths and sends the client's headers."""
    try:
        endpoint = _parse(text, default_port, "", "a base URL")
    except _Refused as refused:
        raise _refusal(refused, text, where, _EXPECTED_BASE) from None
    if endpoint.path or endpoint.userinfo is not None:
        extra = "credentials" if endpoint.userinfo is not None else f"the path {endpoint.path[:40]!r}"
        # (the URL without its credentials: a refusal never echoes a password)
        raise ConfigError(f"{_at(where)}{shown(endpoint.url)} is not a base URL (it has {extra}); {_EXPECTED_BASE}")
    return endpoint


def parse_http_url(text: str, where: str = "URL") -> Endpoint:
    """A URL as a config file writes it (a ladder's `health_url`, `nodes`, `ranks`): `http(s)://` and a host, the
    path as written (empty if none). Anything else, a `HOST:PORT` without a scheme included, is a ConfigError in
    the config files' wording (telemetry/validate.py): `expected an http(s) URL such as ..., got 'x', which ...`."""
    try:
        if isinstance(text, str) and text.strip() and "://" not in text:
            raise _Refused("has no scheme")
        return _parse(text, None, "", "an http(s) URL")
    except _Refused as refused:
        also = f"; {refused.expected}" if refused.expected else ""
        raise ConfigError(f"{_at(where)}{_EXPECTED_HTTP}, got {_shown(text)}, which {refused.problem}{also}") from None


def _parse(text: str, default_port: int | None, default_path: str, what: str) -> Endpoint:
    if not isinstance(text, str):
        raise _Refused("is not a URL")
    value = text.strip()
    if not value:
        raise _Refused("is an empty URL")
    has_scheme = "://" in value
    if not has_scheme:
        if value.count(":") > 1 and not value.startswith("["):
            raise _Refused("is an IPv6 address without brackets", "expected e.g. [::1]:9200")
        value = "http://" + value
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port
    except ValueError:   # a port that is no number from 0 to 65535, brackets that do not close
        raise _Refused("has no valid host and port") from None
    host = parts.hostname or ""
    if parts.scheme not in _SCHEME_PORTS:
        raise _Refused(f"is not {what}")
    if not host or not is_host(host):
        raise _Refused("has no valid host (a host name or an IP address)")
    if port == 0:
        raise _Refused("has port 0", "expected a port from 1 to 65535")
    if port is None:
        if not has_scheme and default_port is None:
            raise _Refused("has no port")
        port = _SCHEME_PORTS[parts.scheme] if has_scheme or default_port is None else default_port
    userinfo, at, _ = parts.netloc.rpartition("@")
    path = parts.path if parts.path not in ("", "/") else default_path
    if parts.query:
        path += "?" + parts.query
    return Endpoint(parts.scheme, host, port, path, userinfo if at else None)


def parse_url_list(text: str, where: str = "URL", *, default_port: int | None = None) -> list[Endpoint]:
    """Comma-separated URLs (empty items are skipped); ConfigError for none or for a bad one."""
    endpoints = [parse_url(part, where, default_port=default_port) for part in text.split(",") if part.strip()]
    if not endpoints:
        raise ConfigError(f"{_at(where)}{_shown(text)} names no URL; expected URL[,URL...]")
    return endpoints


__all__ = ["METRICS_PATH", "REDACTED", "SNAPSHOT_PATH", "Endpoint", "is_host", "parse_base_url", "parse_http_url",
           "parse_url", "parse_url_list", "redact_credentials"]
