"""Telemetry samplers: scrape nodes (the memtel daemon), ranks (the hook exporter) and the server.

`parse_metrics` is pure (text -> samples, with prometheus_client's text parser); the snapshot
functions pick the fixed metric names of docs/architecture.md out of it into the typed snapshots of
harness/ab/records.py. A series that is not exported is None in the snapshot, never 0. A scrape that
fails gives a snapshot with only `error` set.

`NodeSampler` scrapes every node once per `interval_s` in a background thread while a request runs,
to catch the lowest MemAvailable and any swap during a prefill that lasts minutes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from harness.ab.records import NodeSnapshot, RankSnapshot, ServerSnapshot, Snapshot
from telemetry.catalogue import fields, vllm
from telemetry.catalogue.fields import NODE_SNAPSHOT_SERIES, NODE_XID_LABEL
from telemetry.scrape import parse, series_name

Samples = dict[str, list[tuple[dict[str, str], float]]]
S = TypeVar("S", bound=Snapshot)

# Snapshot field -> the series it is read from (telemetry/catalogue/fields.py, one place for both names).
NODE_SERIES = NODE_SNAPSHOT_SERIES
RANK_PROCESS_WIDE = fields.RANK_PROCESS_WIDE  # process-wide allocator values (every site reports them): the largest
RANK_PER_SITE = fields.RANK_PER_SITE          # per-site counters: added up
SERVER_TTFT_SUM = series_name(vllm.TIME_TO_FIRST_TOKEN, "_sum")
SERVER_TTFT_COUNT = series_name(vllm.TIME_TO_FIRST_TOKEN, "_count")
SERVER_PREFIX_CACHE_QUERIES = vllm.PREFIX_CACHE_QUERIES.series  # tokens looked up in the prefix cache
SERVER_PREFIX_CACHE_HITS = vllm.PREFIX_CACHE_HITS.series        # of which found: a cold prefill has none


def parse_metrics(text: str) -> Samples:
    """The samples of exposition `text` by name (telemetry/scrape's parser); ExpositionError for other text."""
    samples: Samples = {}
    for sample in parse(text).samples:
        samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def _sum(samples: Samples, name: str) -> float | None:
    values = samples.get(name)
    return sum(v for _, v in values) if values else None


def _max(samples: Samples, name: str) -> float | None:
    values = samples.get(name)
    return max(v for _, v in values) if values else None


def node_snapshot(samples: Samples, ts: float | None = None) -> NodeSnapshot:
    xids = samples.get(NODE_SERIES["xid_total"]) or []
    values: dict[str, Any] = {key: _sum(samples, name) for key, name in NODE_SERIES.items()}
    return NodeSnapshot(ts=ts, xid_by_code={labels.get(NODE_XID_LABEL, "?"): value for labels, value in xids},
                        **values)


def rank_snapshot(samples: Samples, ts: float | None = None) -> RankSnapshot:
    values: dict[str, Any] = {key: _max(samples, name) for key, name in RANK_PROCESS_WIDE.items()}
    values.update({key: _sum(samples, name) for key, name in RANK_PER_SITE.items()})
    return RankSnapshot(ts=ts, **values)


def server_snapshot(samples: Samples, ts: float | None = None) -> ServerSnapshot:
    return ServerSnapshot(ts=ts, ttft_sum_s=_sum(samples, SERVER_TTFT_SUM),
                          ttft_count=_sum(samples, SERVER_TTFT_COUNT),
                          prefix_cache_queries_total=_sum(samples, SERVER_PREFIX_CACHE_QUERIES),
                          prefix_cache_hits_total=_sum(samples, SERVER_PREFIX_CACHE_HITS))


@dataclass(frozen=True)
class ScrapeSet:
    """One scrape of everything a block watches."""

    nodes: dict[str, NodeSnapshot]
    ranks: dict[str, RankSnapshot]
    server: ServerSnapshot | None


class Scraper:
    def __init__(self, timeout_s: float = 5.0) -> None:
        self.client = httpx.Client(timeout=timeout_s)

    def fetch(self, url: str) -> Samples:
        response = self.client.get(url)
        response.raise_for_status()
        return parse_metrics(response.text)

    def _one(self, url: str, snapshot: Callable[[Samples, float], S], kind: type[S]) -> S:
        try:
            samples = self.fetch(url)
        except Exception as exc:  # a bad endpoint is recorded, never stops the ladder
            return kind(error=f"{type(exc).__name__}: {exc}")
        return snapshot(samples, time.time())

    def node(self, url: str) -> NodeSnapshot:
        return self._one(url, node_snapshot, NodeSnapshot)

    def rank(self, url: str) -> RankSnapshot:
        return self._one(url, rank_snapshot, RankSnapshot)

    def server(self, base_url: str) -> ServerSnapshot:
        return self._one(base_url + "/metrics", server_snapshot, ServerSnapshot)

    def all(self, nodes: dict[str, str], ranks: dict[str, str], server_url: str | None) -> ScrapeSet:
        return ScrapeSet(nodes={name: self.node(url) for name, url in nodes.items()},
                         ranks={name: self.rank(url) for name, url in ranks.items()},
                         server=self.server(server_url) if server_url else None)

    def close(self) -> None:
        self.client.close()


class NodeSampler:
    """Scrapes every node each interval in a thread; keeps the minimum MemAvailable and maximum swap."""

    def __init__(self, nodes: dict[str, str], interval_s: float,
                 on_sample: Callable[[str, NodeSnapshot], None] | None = None) -> None:
        self.nodes = dict(nodes)
        self.interval_s = interval_s
        self.on_sample = on_sample
        self.min_mem_available: dict[str, float] = {}
        self.max_swap_used: dict[str, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> NodeSampler:
        if self.nodes:
            self._thread = threading.Thread(target=self._loop, name="memtel-node-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        scraper = Scraper(timeout_s=min(5.0, max(0.5, self.interval_s)))
        try:
            while True:  # at least one sample, however short the request
                started = time.monotonic()
                for name, url in self.nodes.items():
                    snap = scraper.node(url)
                    self._note(name, snap)
                    if self.on_sample is not None:
                        try:
                            self.on_sample(name, snap)
                        except Exception:  # the sampler must not die with a full disk or such
                            pass
                self.samples += 1
                if self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started))):
                    break
        finally:
            scraper.close()

    def _note(self, name: str, snap: NodeSnapshot) -> None:
        available, swap = snap.mem_available_bytes, snap.swap_used_bytes
        if available is not None:
            self.min_mem_available[name] = min(self.min_mem_available.get(name, available), available)
        if swap is not None:
            self.max_swap_used[name] = max(self.max_swap_used.get(name, swap), swap)
