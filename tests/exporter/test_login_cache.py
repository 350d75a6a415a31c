"""Issue 19, item 5: the login cache evicted the real scraper.

Before: one cache of 100 verdicts held failures too, so anyone without a password could push the real
scraper's cached login out with 100 wrong logins and make its next scrape pay bcrypt again (worst scrape
309 ms under a flood). Now failures are cached apart and never evict a success.
"""

from __future__ import annotations

import base64
import threading
import time

import bcrypt
import httpx
from prometheus_client import CollectorRegistry, Counter

from telemetry.exporter import MetricsServer, ServerLimits
from telemetry.exporter.auth import BasicAuth
from telemetry.exporter.webconfig import WebConfig

PASSWORD = b"the scraper's password"
FLOOD = 250  # more than either cache holds


class _CountingBcrypt:
    """bcrypt, counting the password checks (each one is a cache miss)."""

    def __init__(self) -> None:
        self.checks = 0

    def checkpw(self, password: bytes, hashed: bytes) -> bool:
        self.checks += 1
        return bcrypt.checkpw(password, hashed)


def test_the_login_cache_evicts_the_real_scraper():
    registry = CollectorRegistry()
    Counter("memtel_test_things", "Things counted by the test.", registry=registry).inc()
    auth = BasicAuth({"prometheus": bcrypt.hashpw(PASSWORD, bcrypt.gensalt(10)),
                      "flood": bcrypt.hashpw(b"unguessed", bcrypt.gensalt(4))})  # cheap wrong logins for the flood
    counting = auth._bcrypt = _CountingBcrypt()
    server = MetricsServer("127.0.0.1", 0, registry, web_config=WebConfig(basic_auth=auth))
    server.start()
    try:
        with httpx.Client(timeout=10) as scraper, httpx.Client(timeout=10) as flood:
            started = time.monotonic()
            assert scraper.get(server.url + "/metrics", auth=("prometheus", PASSWORD.decode())).status_code == 200
            first_login = time.monotonic() - started  # one bcrypt check at cost 10
            assert counting.checks == 1
            for i in range(FLOOD):
                assert flood.get(server.url + "/metrics", auth=("flood", f"wrong {i}")).status_code == 401
            assert counting.checks == 1 + FLOOD
            started = time.monotonic()
            response = scraper.get(server.url + "/metrics", auth=("prometheus", PASSWORD.decode()))
            after_flood = time.monotonic() - started
        print(f"first login {first_login * 1e3:.0f} ms; the scraper after {FLOOD} wrong logins "
              f"{after_flood * 1e3:.1f} ms")
        assert response.status_code == 200 and b"memtel_test_things_total" in response.content
        assert counting.checks == 1 + FLOOD  # a cache hit: no bcrypt check for the real scraper
        assert auth.checks == counting.checks
        assert after_flood < first_login
    finally:
        server.stop()


def test_wrong_logins_are_still_refused_from_the_cache():
    auth = BasicAuth({"prometheus": bcrypt.hashpw(PASSWORD, bcrypt.gensalt(4))})

    def header(password: bytes) -> str:
        return "Basic " + base64.b64encode(b"prometheus:" + password).decode()

    assert not auth.check(header(b"wrong")) and not auth.check(header(b"wrong"))  # the second from the cache
    assert auth.check(header(PASSWORD)) and auth.check(header(PASSWORD))
    assert auth.checks == 2 and auth.failures == 2


class _GatedBcrypt:
    """bcrypt whose checks of a wrong password wait at a gate until the test opens it: while it is closed,
    the flood holds the bcrypt check and every worker, however fast or slow the machine is."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = 0

    def checkpw(self, password: bytes, hashed: bytes) -> bool:
        if password != PASSWORD:
            self.entered += 1
            self.gate.wait(60)
        return bcrypt.checkpw(password, hashed)


def test_a_flood_of_new_wrong_logins_does_not_queue_the_real_scraper():
    """Each new wrong password costs a bcrypt check (one at a time, on the workers); the scraper whose login is
    cached is answered without waiting for them. The flood's checks are held at a gate, so every worker is
    busy and more wrong logins wait in the workers' queue: a cached login handed to a worker would wait there
    until the gate opens, which is only after the scrapes (they time out first, and the test fails). No
    timing is compared, so a busy machine cannot fail it."""
    registry = CollectorRegistry()
    Counter("memtel_test_things", "Things counted by the test.", registry=registry).inc()
    auth = BasicAuth({"prometheus": bcrypt.hashpw(PASSWORD, bcrypt.gensalt(4))})
    gated = auth._bcrypt = _GatedBcrypt()
    limits = ServerLimits(workers=2)
    server = MetricsServer("127.0.0.1", 0, registry, web_config=WebConfig(basic_auth=auth), limits=limits)
    server.start()
    stop = threading.Event()

    def flood(worker: int) -> None:
        with httpx.Client(timeout=90) as client:
            for i in range(1000):
                if stop.is_set():
                    return
                client.get(server.url + "/metrics", auth=("prometheus", f"wrong {worker} {i}"))

    flooders = [threading.Thread(target=flood, args=(w,), daemon=True) for w in range(limits.workers + 2)]
    try:
        with httpx.Client(timeout=10) as scraper:
            assert scraper.get(server.url + "/metrics", auth=("prometheus", PASSWORD.decode())).status_code == 200
            assert auth.checks == 1  # the scraper's login is now cached
            for thread in flooders:
                thread.start()
            queued = server._pool._work_queue  # type: ignore[union-attr]  # what waits for a free worker
            deadline = time.monotonic() + 30
            while (gated.entered < 1 or queued.qsize() < 2) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert gated.entered == 1 and queued.qsize() >= 2  # one check held, every worker busy, two waiting
            started = time.monotonic()
            for _ in range(5):
                response = scraper.get(server.url + "/metrics", auth=("prometheus", PASSWORD.decode()))
                assert response.status_code == 200 and b"memtel_test_things_total" in response.content
            took = time.monotonic() - started
            assert not gated.gate.is_set() and gated.entered == 1  # all five answered while the flood was held
            assert auth.checks == 1  # from the cache: no bcrypt check for the real scraper
        print(f"5 scrapes of the cached scraper while the flood held every worker: {took * 1e3:.0f} ms")
        stop.set()
        gated.gate.set()
        deadline = time.monotonic() + 30
        while auth.failures < 3 and time.monotonic() < deadline:  # the held wrong logins are refused once let go
            time.sleep(0.01)
        assert auth.failures >= 3
    finally:
        stop.set()
        gated.gate.set()
        for thread in flooders:
            thread.join(30)
        server.stop()
