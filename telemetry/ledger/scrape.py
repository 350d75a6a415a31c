"""Read the daemons' and the hooks' /metrics and put them into ledgers: one `LedgerReport` per moment.

A URL that does not answer is reported as unreachable with the reason, never as zeros. Hooks are placed on
the node whose daemon has the same host in its URL (the usual deployment: both on the node's address); a hook
with no such daemon is shown under its own `node` label. A node is called by the `node` label its hooks export
(the name the hook and the guard use), a loopback daemon without hooks by this host's name (the hook's default),
else by its URL's host. Every endpoint is read as hostile (telemetry/scrape/fetch.py): one deadline for all of
them, bodies bounded and whole, a value no count can have (NaN, infinite, 2**63 or more) unknown. URLs, default
ports and series names come from telemetry/scrape and the catalogue, never typed here.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from telemetry.catalogue import FAMILIES, Family
from telemetry.catalogue import metrics as catalogue
from telemetry.ledger.lines import NodeLedger, ProcessLedger
from telemetry.scrape import DAEMON_PORT, Exposition, FetchError, Sample, hook_ports, read_metrics
from telemetry.url import METRICS_PATH, Endpoint, parse_url, parse_url_list

MAX_BODY_BYTES = 8 << 20     # a daemon's body is ~30 kB; a hook's with many sites a few hundred kB
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_DAEMON = Endpoint("http", "127.0.0.1", DAEMON_PORT, METRICS_PATH).url
# What a hook's engine exports of its process (weights, KV cache, ...): its labels rank, node, pid name the process.
ENGINE_FAMILIES = tuple(entry for entry in FAMILIES.values() if entry.source == "engine")


@dataclass(frozen=True)
class Scrape:
    url: str
    metrics: Exposition = field(default_factory=Exposition)
    error: str | None = None    # why it could not be read (None: it answered)

    @property
    def samples(self) -> tuple[Sample, ...]:
        return self.metrics.samples

    def values(self, entry: Family, **match: str) -> list[Sample]:
        return self.metrics.of(entry, **match)

    def first(self, entry: Family, **match: str) -> float | None:
        return self.metrics.first(entry, **match)

    def total(self, entry: Family) -> float | None:
        return self.metrics.total(entry)


def metrics_url(text: str) -> str:
    """`host:port`, `http://host:port` or a full URL -> the /metrics URL (telemetry/url.py); ConfigError
    for anything else."""
    return parse_url(text, "").url


def url_list(text: str) -> list[str]:
    return [endpoint.url for endpoint in parse_url_list(text, "")]


def scrape(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, deadline: float | None = None) -> Scrape:
    """Read one /metrics URL (http(s) only: metrics_url) whole before `deadline` (time.monotonic(); default
    `timeout_s` from now); an endpoint that cannot be read, or answers anything but a whole /metrics body, is a
    Scrape with the reason."""
    end = time.monotonic() + timeout_s if deadline is None else deadline
    try:
        return Scrape(url, read_metrics(url, end, MAX_BODY_BYTES))
    except FetchError as error:
        return Scrape(url, error=str(error))


def scrape_all(urls: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Scrape]:
    """Every URL at once, all within one deadline `timeout_s` from now."""
    if not urls:
        return []
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return list(pool.map(lambda u: scrape(u, deadline=deadline), urls))


MAX_SHOWN_VALUE = 2**63   # no memory figure or count is larger: a larger (or infinite, NaN) value is unknown


def _int(value: float | None) -> int | None:
    if value is None or not math.isfinite(value) or abs(value) >= MAX_SHOWN_VALUE:
        return None
    return int(value)


@dataclass(frozen=True)
class HookView:
    url: str
    node_label: str | None
    process: ProcessLedger | None
    calls: int | None
    growth_events: int | None
    max_prefill_tokens: int | None
    error: str | None = None


@dataclass
class NodeView:
    name: str
    daemon_url: str | None
    error: str | None = None
    ledger: NodeLedger | None = None
    headroom: int | None = None
    contiguous_free: int | None = None
    mem_available: int | None = None
    kernel_errors: dict[str, int] = field(default_factory=dict)
    hooks: list[HookView] = field(default_factory=list)


@dataclass
class LedgerReport:
    taken_at: float
    nodes: list[NodeView]
    unreachable_default_hooks: bool = False   # no hook answered on the default ports

    def as_dict(self) -> dict[str, Any]:
        def node(n: NodeView) -> dict[str, Any]:
            return {
                "node": n.name, "daemon": n.daemon_url, "error": n.error,
                "lines": None if n.ledger is None else {"total": n.ledger.total, "used": n.ledger.used,
                                                        **n.ledger.lines()},
                "unified_memory": None if n.ledger is None else n.ledger.unified,
                "headroom_bytes": n.headroom, "contiguous_free_bytes": n.contiguous_free,
                "mem_available_bytes": n.mem_available, "kernel_errors": n.kernel_errors,
                "processes": [{"hook": h.url, "error": h.error, "calls": h.calls, "growth_events": h.growth_events,
                               "max_prefill_tokens": h.max_prefill_tokens,
                               **({} if h.process is None else h.process.as_dict())} for h in n.hooks],
            }
        return {"taken_at": self.taken_at, "nodes": [node(n) for n in self.nodes],
                "no_hook_on_default_ports": self.unreachable_default_hooks}


KERNEL_ERRORS = {"nv_err_no_memory": catalogue.KERNEL_NV_ERR_NO_MEMORY[1], "xid": catalogue.KERNEL_XID[1],
                 "oom_kill": catalogue.KERNEL_OOM_KILLS[1]}   # each kind's events (bursts of lines)


# What only a node's daemon exports: every family but those of the serving process (its hook, engine, forecast),
# of the hook's and the daemon's shared HTTP server, the guard and the lab.
DAEMON_FAMILIES = tuple(entry for entry in FAMILIES.values()
                        if entry.source not in ("hook", "engine", "forecast", "exporter", "guard", "lab"))
NOT_A_DAEMON = f"not a memtel daemon (none of its node series; the daemon's port is {DAEMON_PORT})"  # fits top's 80


def _daemon_answered(scrape_: Scrape) -> bool:
    """Whether any family only a daemon exports is in the answer: the catalogue's, and the ones the view reads
    (looked up now, so a renamed entry is followed)."""
    read = (catalogue.MEM_TOTAL, catalogue.MEM_AVAILABLE, catalogue.UNIFIED_HEADROOM, catalogue.MEM_FREE_CONTIGUOUS)
    return any(scrape_.values(entry) for entry in (*read, *DAEMON_FAMILIES))


def node_view(name: str, scrape_: Scrape) -> NodeView:
    """A daemon's answer as a node; one that answers without any daemon series (another exporter, a hook, a web
    server answering 200) is an error, never a node of unknowns."""
    error = scrape_.error
    if error is None and not _daemon_answered(scrape_):
        error = NOT_A_DAEMON
    view = NodeView(name, scrape_.url, error=error)
    if error is not None:
        return view
    shares = [_int(s.value) for s in scrape_.values(catalogue.GPU_PROCESS_MEMORY_USED)]
    gpu_processes = [v for v in shares if v is not None]
    unified_values = scrape_.values(catalogue.GPU_UNIFIED_MEMORY)
    unified = None if not unified_values else any(s.value == 1 for s in unified_values)
    view.ledger = NodeLedger.from_values(
        mem_total=_int(scrape_.first(catalogue.MEM_TOTAL)),
        mem_free=_int(scrape_.first(catalogue.MEM_FREE)),
        active_file=_int(scrape_.first(catalogue.MEM_ACTIVE_FILE)),
        inactive_file=_int(scrape_.first(catalogue.MEM_INACTIVE_FILE)),
        unaccounted=_int(scrape_.first(catalogue.MEM_UNACCOUNTED)),
        gpu_process_bytes=gpu_processes, unified=unified)
    view.headroom = _int(scrape_.first(catalogue.UNIFIED_HEADROOM))
    view.contiguous_free = _int(scrape_.first(catalogue.MEM_FREE_CONTIGUOUS))
    view.mem_available = _int(scrape_.first(catalogue.MEM_AVAILABLE))
    for short, entry in KERNEL_ERRORS.items():
        value = _int(scrape_.total(entry))
        if value is not None:
            view.kernel_errors[short] = value
    return view


def hook_view(scrape_: Scrape, daemon: Scrape | None) -> HookView:
    if scrape_.error is not None:
        return HookView(scrape_.url, None, None, None, None, None, error=scrape_.error)
    engine = {entry: found[0] for entry in ENGINE_FAMILIES if (found := scrape_.values(entry))}
    any_sample = next(iter(engine.values()), None)
    labels = any_sample.labels if any_sample is not None else {}
    rank = labels.get("rank") or scrape_.metrics.labelled("rank") or ""
    node_label = labels.get("node") or scrape_.metrics.labelled("node")
    pid = labels.get("pid", "")

    def value(entry: Family) -> int | None:
        sample = engine.get(entry)
        return None if sample is None else _int(sample.value)

    nvml = None
    if daemon is not None and daemon.error is None and pid:
        found = daemon.values(catalogue.GPU_PROCESS_MEMORY_USED, pid=pid)
        shares = [_int(s.value) for s in found]
        nvml = sum(v for v in shares if v is not None) if found and None not in shares else None
    process = None
    if engine:
        process = ProcessLedger.from_values(
            rank=rank, pid=pid, weights=value(catalogue.ENGINE_WEIGHTS), kv_cache=value(catalogue.ENGINE_KV_CACHE),
            cuda_graph_pool=value(catalogue.ENGINE_CUDA_GRAPH_POOL),
            reserved=value(catalogue.ENGINE_ALLOCATOR_RESERVED),
            allocated=value(catalogue.ENGINE_ALLOCATOR_ALLOCATED), nvml_process_bytes=nvml,
            device_used_bytes=value(catalogue.ENGINE_DEVICE_USED), host_rss=value(catalogue.ENGINE_RESIDENT))
    elif rank:
        process = ProcessLedger.from_values(rank=rank, pid="", weights=None, kv_cache=None, cuda_graph_pool=None,
                                            reserved=None, allocated=None, nvml_process_bytes=None,
                                            device_used_bytes=None, host_rss=None)
    max_fit = scrape_.first(catalogue.FORECAST_MAX_PREFILL_TOKENS)
    return HookView(scrape_.url, node_label, process, calls=_int(scrape_.total(catalogue.HOOK_CALLS)),
                    growth_events=_int(scrape_.total(catalogue.HOOK_GROWTH_EVENTS)),
                    max_prefill_tokens=_int(max_fit))


def _host(url: str) -> str:
    return parse_url(url).host


def _loopback(url: str) -> bool:
    host = _host(url)
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _name_by_hooks(nodes: list[NodeView], daemon_urls: Sequence[str]) -> None:
    """Call each daemon's node what its hooks call it (their one `node` label), a loopback daemon without hooks
    this host's name (the hook's default label), unless two nodes would then share a name."""
    names: list[str] = []
    for node, url in zip(nodes, daemon_urls, strict=True):
        labels = {h.node_label for h in node.hooks if h.node_label}
        if len(labels) == 1:
            names.append(labels.pop())
        elif not node.hooks and _loopback(url):
            names.append(socket.gethostname())
        else:
            names.append(node.name)
    for node, name in zip(nodes, names, strict=True):
        if names.count(name) == 1:
            node.name = name


def default_hook_urls(hosts: Iterable[str]) -> list[str]:
    return [Endpoint("http", host, port, METRICS_PATH).url for host in hosts for port in hook_ports()]


def take_report(daemon_urls: Sequence[str], hook_urls: Sequence[str] | None, *,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> LedgerReport:
    """Scrape everything at once and build the report. `hook_urls` None: the default hook ports on each
    daemon's host, where only those that answer are shown."""
    default_hooks = hook_urls is None
    hosts = [_host(u) for u in daemon_urls]
    hooks = default_hook_urls(dict.fromkeys(hosts)) if hook_urls is None else list(hook_urls)
    scrapes = scrape_all([*daemon_urls, *hooks], timeout_s)
    daemons, hook_scrapes = scrapes[:len(daemon_urls)], scrapes[len(daemon_urls):]
    if default_hooks:
        hook_scrapes = [s for s in hook_scrapes if s.error is None]
    nodes: list[NodeView] = []
    by_host: dict[str, tuple[NodeView, Scrape]] = {}
    for url, daemon in zip(daemon_urls, daemons, strict=True):
        host = _host(url)
        node = node_view(host, daemon)
        nodes.append(node)
        by_host.setdefault(host, (node, daemon))
    orphans: dict[str, NodeView] = {}
    for hook in hook_scrapes:
        host = _host(hook.url)
        placed = by_host.get(host)
        view = hook_view(hook, placed[1] if placed else None)
        if placed is not None:
            placed[0].hooks.append(view)
        else:
            name = view.node_label or host
            orphans.setdefault(name, NodeView(name, None, error="no daemon given for this node")).hooks.append(view)
    _name_by_hooks(nodes, daemon_urls)
    nodes.extend(orphans.values())
    return LedgerReport(time.time(), nodes, unreachable_default_hooks=default_hooks and not hook_scrapes)


__all__ = ["DEFAULT_DAEMON", "NOT_A_DAEMON", "HookView", "LedgerReport", "NodeView", "Sample", "Scrape", "metrics_url",
           "scrape", "take_report", "url_list"]
