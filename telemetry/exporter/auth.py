"""HTTP basic auth against bcrypt hashes, as the Prometheus exporter toolkit checks it.

bcrypt is slow on purpose (about 70 ms at cost 10), so, like the toolkit, a verdict is cached per
(user, hash, password) digest: a scraper that sends the same credentials every second pays once. An
unknown user is checked against a fixed dummy hash, so the answer takes as long as for a known one.
One check runs at a time; cached answers do not wait for it.

Successes and failures are cached apart, each bounded and evicting its own least recently used entry:
anyone can send failures (no password needed), so a flood of wrong logins must never push the real
scraper's cached success out and make it pay bcrypt again.

The hashes need the `bcrypt` package (`pip install 'memtel[auth]'`); without it a web config with
`basic_auth_users` is refused at start with one line that says so.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import os
import re
import threading
from typing import Any

from telemetry.errors import ConfigError

_BCRYPT_HASH = re.compile(r"^\$2[abxy]?\$(\d\d)\$[./A-Za-z0-9]{53}$")
_USER = re.compile(r"^[^:\x00-\x1f\x7f]{1,256}$")
_CACHE_ENTRIES = 100  # per verdict: successes and failures each


class BasicAuth:
    def __init__(self, users: dict[str, bytes]) -> None:
        import bcrypt  # checked by from_mapping; imported here so a missing package fails at start

        self._bcrypt = bcrypt
        self.users = users
        self._succeeded: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._failed: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._check_lock = threading.Lock()
        self.failures = 0
        self.checks = 0  # bcrypt checks made (cache misses)
        # Unknown users are checked against a hash of a random password at the users' highest cost.
        cost = max(int(h.split(b"$")[2]) for h in users.values())
        self._dummy_hash = bcrypt.hashpw(base64.b64encode(os.urandom(18)), bcrypt.gensalt(cost))

    @classmethod
    def from_mapping(cls, data: Any, where: str) -> BasicAuth:
        if not isinstance(data, dict) or not data:
            raise ConfigError(f"{where}: expected a mapping of user names to bcrypt hashes")
        users: dict[str, bytes] = {}
        for user, hashed in data.items():
            if not isinstance(user, str) or not _USER.match(user):
                raise ConfigError(f"{where}: {str(user)[:40]!r} is not a user name (no ':' or control characters)")
            if not isinstance(hashed, str) or not _BCRYPT_HASH.match(hashed):
                raise ConfigError(f"{where}.{user}: expected a bcrypt hash ($2y$10$ and 53 characters, e.g. from "
                                  "`htpasswd -nBC 10 \"\" | tr -d ':\\n'`), not a plain password")
            cost = int(_BCRYPT_HASH.match(hashed).group(1))  # type: ignore[union-attr]
            if not 4 <= cost <= 31:
                raise ConfigError(f"{where}.{user}: bcrypt cost {cost} is outside 4..31")
            users[user] = hashed.encode("ascii")
        try:
            import bcrypt  # noqa: F401  (only to say clearly that it is missing)
        except ImportError:
            raise ConfigError(f"{where}: checking bcrypt hashes needs the bcrypt package: "
                              "pip install 'memtel[auth]' (or pip install bcrypt)") from None
        return cls(users)

    def check(self, authorization: str | None) -> bool:
        """True if the `Authorization` header value carries a known user and the right password."""
        parsed = self._parse(authorization)
        if parsed is None:
            return False
        key, hashed, password = parsed
        verdict = self._cached(key)
        if verdict is None:
            with self._check_lock:
                try:
                    matches = self._bcrypt.checkpw(password, hashed or self._dummy_hash)
                except ValueError:
                    matches = False
            verdict = hashed is not None and matches
            with self._cache_lock:
                self.checks += 1
                cache = self._succeeded if verdict else self._failed
                cache[key] = None
                cache.move_to_end(key)
                if len(cache) > _CACHE_ENTRIES:
                    cache.popitem(last=False)
        if not verdict:
            with self._cache_lock:
                self.failures += 1
        return verdict

    def answered_without_bcrypt(self, authorization: str | None) -> bool:
        """Whether `check` can answer at once (a malformed header, or a cached verdict): the server then
        answers on its selector thread, and only logins that need a bcrypt check wait for a worker."""
        parsed = self._parse(authorization)
        return parsed is None or self._cached(parsed[0]) is not None

    def _parse(self, authorization: str | None) -> tuple[bytes, bytes | None, bytes] | None:
        """(cache key, the user's hash or None, password) of a Basic header; None if it is not one."""
        if not authorization:
            return None
        scheme, _, encoded = authorization.strip().partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        user_bytes, sep, password = decoded.partition(b":")
        if not sep:
            return None
        hashed = self.users.get(user_bytes.decode("utf-8", "replace"))
        return hashlib.sha256(b"\0".join((user_bytes, hashed or b"", password))).digest(), hashed, password

    def _cached(self, key: bytes) -> bool | None:
        with self._cache_lock:
            for cache, verdict in ((self._succeeded, True), (self._failed, False)):
                if key in cache:
                    cache.move_to_end(key)
                    return verdict
        return None


__all__ = ["BasicAuth"]
