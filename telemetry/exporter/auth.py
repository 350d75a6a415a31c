"""HTTP basic auth against bcrypt hashes, as the Prometheus exporter toolkit checks it.

bcrypt is slow on purpose (about 70 ms at cost 10), so, like the toolkit, a verdict is cached per
(user, hash, password) digest: a scraper that sends the same credentials every second pays once. An
unknown user is checked against a fixed dummy hash, so the answer takes as long as for a known one.
One check runs at a time; cached answers do not wait for it.

The hashes need the `bcrypt` package (`pip install 'memtel[auth]'`); without it a web config with
`basic_auth_users` is refused at start with one line that says so.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import threading
from typing import Any

from telemetry.errors import ConfigError

_BCRYPT_HASH = re.compile(r"^\$2[abxy]?\$(\d\d)\$[./A-Za-z0-9]{53}$")
_USER = re.compile(r"^[^:\x00-\x1f\x7f]{1,256}$")
_CACHE_ENTRIES = 100


class BasicAuth:
    def __init__(self, users: dict[str, bytes]) -> None:
        import bcrypt  # checked by from_mapping; imported here so a missing package fails at start

        self._bcrypt = bcrypt
        self.users = users
        self._cache: dict[bytes, bool] = {}
        self._cache_lock = threading.Lock()
        self._check_lock = threading.Lock()
        self.failures = 0
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
        if not authorization:
            return False
        scheme, _, encoded = authorization.strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        user_bytes, sep, password = decoded.partition(b":")
        if not sep:
            return False
        user = user_bytes.decode("utf-8", "replace")
        hashed = self.users.get(user)
        key = hashlib.sha256(b"\0".join((user_bytes, hashed or b"", password))).digest()
        verdict = self._cache.get(key)
        if verdict is None:
            with self._check_lock:
                try:
                    matches = self._bcrypt.checkpw(password, hashed or self._dummy_hash)
                except ValueError:
                    matches = False
            verdict = hashed is not None and matches
            with self._cache_lock:
                if len(self._cache) >= _CACHE_ENTRIES:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = verdict
        if not verdict:
            with self._cache_lock:
                self.failures += 1
        return verdict


__all__ = ["BasicAuth"]
