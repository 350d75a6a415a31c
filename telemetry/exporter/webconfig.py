"""The web config file of the Prometheus exporter toolkit (node_exporter's `--web.config.file`), read by memtel.

An SRE who protects node_exporter with TLS and basic auth points memtel at the same file:

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file's directory
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional; needs client_ca_file
      client_ca_file: clients-ca.crt
      min_version: TLS12             # optional: TLS10..TLS13 (default TLS12)
      max_version: TLS13
    http_server_config:
      headers: {X-Content-Type-Options: nosniff}   # added to every response
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt hashes, e.g. from `htpasswd -nBC 10 "" | tr -d ':\\n'`

What memtel does not implement is refused with one line rather than ignored: client_auth_type
RequestClientCert and RequireAnyClientCert (Python's ssl cannot ask for a certificate without
verifying it), cipher_suites, curve_preferences, client_allowed_sans, inline cert/key/client_ca
and rate_limit. `http2` is accepted and ignored (memtel serves HTTP/1.1). The file is read once at
start (the toolkit re-reads it per request): restart to pick up a new certificate.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from telemetry import hook_env
from telemetry.errors import ConfigError
from telemetry.exporter.auth import BasicAuth
from telemetry.validate import Validator, join, kind

WEB_CONFIG_ENV = hook_env.WEB_CONFIG  # the hook's way to name a web config file (the daemon has --web-config)

_TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version")
_TLS_UNSUPPORTED = ("cert", "key", "client_ca", "client_allowed_sans", "cipher_suites", "curve_preferences",
                    "prefer_server_cipher_suites")
_HTTP_KEYS = ("http2", "headers")
_TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users")
_TOP_UNSUPPORTED = ("rate_limit",)
_TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                 "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_CLIENT_AUTH = {"": ssl.CERT_NONE, "NoClientCert": ssl.CERT_NONE,
                "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL, "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_HEADER_VALUE = re.compile(r"^[\x20-\x7e]{0,1024}$")


@dataclass(frozen=True)
class WebConfig:
    """What the server needs: a TLS context (None: plain HTTP), basic auth (None: open), extra headers."""

    path: str | None = None
    tls: ssl.SSLContext | None = None
    basic_auth: BasicAuth | None = None
    headers: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def describe(self) -> str:
        """For the start-up log line: "TLS, basic auth (2 users)" or "plain HTTP, no auth"."""
        parts = ["TLS" if self.tls is not None else "plain HTTP"]
        if self.tls is not None and self.tls.verify_mode == ssl.CERT_REQUIRED:
            parts.append("client certificates required")
        parts.append(f"basic auth ({len(self.basic_auth.users)} users)" if self.basic_auth else "no auth")
        return ", ".join(parts)


_FIELDS = Validator(None)  # the paths below start with the file's name (`web.yml: tls_server_config`)


def _section(data: Any, allowed: tuple[str, ...], unsupported: tuple[str, ...], where: str) -> dict[str, Any]:
    if data is None:
        return {}
    reason = f"not supported by memtel's exporter (supported: {', '.join(allowed)})"
    return _FIELDS.mapping(data, where, (), allowed, dict.fromkeys(unsupported, reason))


def _string(data: dict[str, Any], key: str, where: str) -> str:
    value = data.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _FIELDS.fail(join(where, key), f"expected a string, got {kind(value)}")
    return value


def _file(base: Path, data: dict[str, Any], key: str, where: str) -> str:
    name = _string(data, key, where)
    if not name:
        return ""
    path = base / name
    if not path.is_file():
        raise ConfigError(f"{where}.{key}: {path} is not a readable file")
    return str(path)


def _tls_context(section: dict[str, Any], base: Path, where: str) -> ssl.SSLContext | None:
    if not any(section.get(k) for k in _TLS_KEYS):
        return None
    cert = _file(base, section, "cert_file", where)
    key = _file(base, section, "key_file", where)
    if not cert:
        raise ConfigError(f"{where}: missing cert_file")
    if not key:
        raise ConfigError(f"{where}: missing key_file")
    auth_type = _string(section, "client_auth_type", where)
    if auth_type not in _CLIENT_AUTH:
        hint = ""
        if auth_type in ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert"):
            hint = " (not supported: Python's ssl verifies every client certificate it asks for)"
        raise ConfigError(f"{where}.client_auth_type: {auth_type!r}{hint}; valid: "
                          f"{', '.join(k for k in _CLIENT_AUTH if k)}")
    client_ca = _file(base, section, "client_ca_file", where)
    verify = _CLIENT_AUTH[auth_type]
    if client_ca and verify == ssl.CERT_NONE:
        raise ConfigError(f"{where}: client_ca_file is set without a client_auth_type "
                          "(expected RequireAndVerifyClientCert or VerifyClientCertIfGiven)")
    if verify != ssl.CERT_NONE and not client_ca:
        raise ConfigError(f"{where}.client_auth_type {auth_type} needs client_ca_file")
    versions = []
    for key_name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        name = _string(section, key_name, where) or default
        if name not in _TLS_VERSIONS:
            raise ConfigError(f"{where}.{key_name}: unknown TLS version {name!r}; valid: {', '.join(_TLS_VERSIONS)}")
        versions.append(_TLS_VERSIONS[name])
    if versions[0] > versions[1]:
        raise ConfigError(f"{where}: min_version is above max_version")

    def no_passphrase() -> bytes:
        raise ConfigError(f"{where}.key_file: {key} is encrypted; expected an unencrypted PEM key "
                          "(readable by the exporter's user only)")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.minimum_version, context.maximum_version = versions[0], versions[1]
        context.load_cert_chain(cert, key, password=no_passphrase)
        if client_ca:
            context.load_verify_locations(cafile=client_ca)
    except ConfigError:
        raise
    except ssl.SSLError as exc:
        raise ConfigError(f"{where}: cannot load the certificate, key or CA: {exc.reason or exc}") from None
    except ValueError as exc:  # e.g. a TLS version this OpenSSL build does not offer
        raise ConfigError(f"{where}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read the certificate, key or CA: {exc.strerror or exc}") from None
    context.verify_mode = verify
    return context


def _headers(section: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    headers = section.get("headers") or {}
    if not isinstance(headers, dict):
        raise ConfigError(f"{where}.headers: expected a mapping of header names to values")
    out = []
    for name, value in headers.items():
        if not isinstance(name, str) or not _HEADER_NAME.match(name):
            raise ConfigError(f"{where}.headers: {name!r} is not a header name")
        if not isinstance(value, str) or not _HEADER_VALUE.match(value):
            raise ConfigError(f"{where}.headers.{name}: expected printable ASCII text of at most 1024 characters")
        if name.lower() in ("content-type", "content-length", "connection", "www-authenticate", "transfer-encoding"):
            raise ConfigError(f"{where}.headers.{name}: this header is set by the exporter itself")
        value = value.strip(" ")  # spaces around a value are not part of it (RFC 9110 section 5.5); h11 refuses them
        if value:
            out.append((name, value))
    http2 = section.get("http2", True)
    if not isinstance(http2, bool):
        raise ConfigError(f"{where}.http2: expected true or false")
    return tuple(out)


def web_config_from_mapping(data: Any, source: str, base_dir: Path) -> WebConfig:
    top = _section({} if data is None else data, _TOP_KEYS, _TOP_UNSUPPORTED, source)
    tls = _tls_context(_section(top.get("tls_server_config"), _TLS_KEYS, _TLS_UNSUPPORTED,
                                f"{source}: tls_server_config"), base_dir, f"{source}: tls_server_config")
    headers = _headers(_section(top.get("http_server_config"), _HTTP_KEYS, (), f"{source}: http_server_config"),
                       f"{source}: http_server_config")
    users = top.get("basic_auth_users")
    basic_auth = BasicAuth.from_mapping(users, f"{source}: basic_auth_users") if users else None
    return WebConfig(path=source, tls=tls, basic_auth=basic_auth, headers=headers)


def load_web_config(path: str | os.PathLike[str] | None) -> WebConfig:
    """Read a web config file (None or "": plain HTTP, no auth). ConfigError says what is wrong, in one line."""
    if not path:
        return WebConfig()
    from telemetry.safeyaml import load_yaml_file

    data = load_yaml_file(path, "web config file")
    return web_config_from_mapping(data, str(path), Path(path).parent)


__all__ = ["WEB_CONFIG_ENV", "WebConfig", "load_web_config", "web_config_from_mapping"]
