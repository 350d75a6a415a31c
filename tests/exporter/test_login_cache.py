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

from telemetry.exporter import MetricsServer
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


def test_a_flood_of_new_wrong_logins_does_not_queue_the_real_scraper():
    """Each new wrong password costs a bcrypt check (one at a time, on the workers); the scraper whose login is
    cached is answered without waiting for them."""
    registry = CollectorRegistry()
    Counter("memtel_test_things", "Things counted by the test.", registry=registry).inc()
    auth = BasicAuth({"prometheus": bcrypt.hashpw(PASSWORD, bcrypt.gensalt(9))})
    server = MetricsServer("127.0.0.1", 0, registry, web_config=WebConfig(basic_auth=auth))
    server.start()
    stop = threading.Event()

    def flood(worker: int) -> None:
        with httpx.Client(timeout=30) as client:
            for i in range(1000):
                if stop.is_set():
                    return
                client.get(server.url + "/metrics", auth=("prometheus", f"wrong {worker} {i}"))

    flooders = [threading.Thread(target=flood, args=(w,), daemon=True) for w in range(4)]
    try:
        with httpx.Client(timeout=10) as scraper:
            started = time.monotonic()
            assert scraper.get(server.url + "/metrics", auth=("prometheus", PASSWORD.decode())).status_code == 200
            first_login = time.monotonic() - started  # one bcrypt check
            for thread in flooders:
                thread.start()
            deadline = time.monotonic() + 10
            while auth.failures < 3 and time.monotonic() < deadline:  # the flood has reached the bcrypt checks
                time.sleep(0.01)
            worst = 0.0
            for _ in range(5):
                started = time.monotonic()
                assert scraper.get(server.url + "/metrics", auth=("prometheus", PASSWORD.decode())).status_code == 200
                worst = max(worst, time.monotonic() - started)
        print(f"first login {first_login * 1e3:.0f} ms; worst scrape of the cached scraper during a flood of new "
              f"wrong logins: {worst * 1e3:.0f} ms")
        assert worst < first_login  # queued behind the flood's bcrypt checks, it took several of them
    finally:
        stop.set()
        for thread in flooders:
            thread.join(30)
        server.stop()
