"""`memtel top`: the ledger, live in the terminal, every second (like nvtop or gpustat, correct on unified memory).

Per node: headroom and its trend, contiguous free memory, the ledger's lines, the engine's requests running and
whether they progress (a stall as MemtelEngineStalled defines it: telemetry/ledger/stall.py); per process: the
ledger's row, hooked calls and growth events since the last frame; kernel-log errors as they arrive. Keys: q quit,
p pause, s next sort, r refresh now. `--once` (or a dumb terminal, or output that is not a terminal) prints one frame
and exits. Nothing here writes anything: it only reads the exporters.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from telemetry.errors import printable
from telemetry.ledger.flags import SECONDS, add_sources, could_not_read, url_list
from telemetry.ledger.render import PROCESS_HEADER, SORTS, node_block, process_row, size
from telemetry.ledger.scrape import LedgerReport, NodeView, Scrape, scrape_all, take_report
from telemetry.ledger.stall import EngineState, StallWatch, engine_numbers
from telemetry.scrape.ports import HOOK_PORT_RANGE, LAB_PORT
from telemetry.url import METRICS_PATH, Endpoint, parse_url

TREND_WINDOW_S = 10.0
KEYS = "[q]uit [p]ause [s]ort [r]efresh"
DEFAULT_ENGINE_PORT = LAB_PORT   # vLLM's default --port (the lab's too): its /metrics is on its API's port


@dataclass
class History:
    """What the frames before this one saw: headroom over time per node, counters per hook, kernel errors."""

    headroom: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    calls: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    kernel: dict[str, dict[str, int]] = field(default_factory=dict)
    events: deque[str] = field(default_factory=lambda: deque(maxlen=50))
    stall: StallWatch = field(default_factory=StallWatch)
    engines: dict[str, EngineState] = field(default_factory=dict)  # this frame's, by node (or engine host)
    engine_errors: dict[str, str] = field(default_factory=dict)    # engines asked for that did not answer: URL -> why

    def trend(self, node: str) -> float | None:
        """Headroom change in bytes per second over the last TREND_WINDOW_S (None with fewer than 2 points)."""
        points = self.headroom.get(node)
        if not points or len(points) < 2:
            return None
        (t0, h0), (t1, h1) = points[0], points[-1]
        return None if t1 <= t0 else (h1 - h0) / (t1 - t0)

    def update(self, report: LedgerReport, engines: Sequence[Scrape] = ()) -> dict[str, tuple[int | None, int | None]]:
        """Record this report and the engines' /metrics read with it; returns per hook URL (calls, growth events)
        since the last frame."""
        now = report.taken_at
        deltas: dict[str, tuple[int | None, int | None]] = {}
        stamp = time.strftime("%H:%M:%S", time.localtime(now))
        for node in report.nodes:
            if node.headroom is not None:
                points = self.headroom.setdefault(node.name, deque())
                points.append((now, node.headroom))
                while points and now - points[0][0] > TREND_WINDOW_S:
                    points.popleft()
            before = self.kernel.get(node.name)
            for kind, count in node.kernel_errors.items():
                if before is not None and count > before.get(kind, 0):
                    self.events.append(f"{stamp} {node.name}: kernel log {kind} +{count - before.get(kind, 0)}")
            if node.error is None:
                self.kernel[node.name] = dict(node.kernel_errors)
            for hook in node.hooks:
                old = self.calls.get(hook.url)
                if old is not None and hook.calls is not None and old[0] is not None:
                    grew = (None if hook.growth_events is None or old[1] is None
                            else hook.growth_events - old[1])
                    deltas[hook.url] = (hook.calls - old[0], grew)
                    if grew:
                        self.events.append(f"{stamp} {node.name}: rank {hook.process.rank if hook.process else '?'}"
                                           f" +{grew} growth events")
                if hook.error is None:
                    self.calls[hook.url] = (hook.calls, hook.growth_events)
        self._engines(report, engines, stamp)
        return deltas

    def _engines(self, report: LedgerReport, engines: Sequence[Scrape], stamp: str) -> None:
        """Each node's engines (placed by host, as the hooks are) with its hooks' calls, through the stall watch."""
        self.engine_errors = {e.url: e.error for e in engines if e.error is not None}
        placed: dict[str, tuple[NodeView | None, list[Scrape]]] = {}
        for engine in engines:
            if engine.error is None:
                node = _node_of(report, engine.url)
                key = node.name if node is not None else parse_url(engine.url).host
                placed.setdefault(key, (node, []))[1].append(engine)
        states: dict[str, EngineState] = {}
        for key, (node, answered) in placed.items():
            counters: dict[str, float | None] = {}
            running: list[float] = []
            for engine in answered:
                count, progress = engine_numbers(engine.metrics)
                if count is not None:
                    running.append(count)
                counters.update({f"{engine.url} {name}": value for name, value in progress.items()})
            for hook in node.hooks if node is not None else []:
                counters[f"{hook.url} calls"] = None if hook.error is not None else hook.calls
            state = self.stall.observe(key, report.taken_at, min(running) if running else None, counters)
            was = self.engines.get(key)
            if state.stalled and (was is None or not was.stalled):
                self.events.append(f"{stamp} {key}: engine {state.text()}")
            states[key] = state
        self.engines = states


def _node_of(report: LedgerReport, url: str) -> NodeView | None:
    """The node an engine's URL belongs to: the one whose daemon, else one of whose hooks, has the same host."""
    host = parse_url(url).host
    for node in report.nodes:
        if node.daemon_url and parse_url(node.daemon_url).host == host:
            return node
    for node in report.nodes:
        if any(parse_url(h.url).host == host for h in node.hooks):
            return node
    return None


def frame(report: LedgerReport, history: History, deltas: dict[str, tuple[int | None, int | None]], *,
          sort: str, paused: bool, width: int, height: int, interval: float) -> list[str]:
    stamp = time.strftime("%H:%M:%S", time.localtime(report.taken_at))
    state = "PAUSED" if paused else f"every {interval:g}s"
    lines = [f"memtel top  {stamp}  {state}  sort: {sort}  {KEYS}"]
    for node in report.nodes:
        block = node_block(node)
        trend = history.trend(node.name)
        if trend is not None and node.error is None:
            block[0] += f"  headroom {'+' if trend >= 0 else '-'}{size(int(abs(trend)))}/s"
        lines.extend(block)
        engine = history.engines.get(node.name)
        if engine is not None:
            lines.append(f"  engine: {engine.text()}")
        if node.hooks:
            lines.append(PROCESS_HEADER)
            for hook in sorted(node.hooks, key=SORTS[sort]):
                lines.append(process_row(hook))
                calls, grew = deltas.get(hook.url, (None, None))
                if hook.error is None and hook.calls is not None:
                    lines.append(f"{'':14}calls {hook.calls:,}" + (f" (+{calls})" if calls else "")
                                 + (f"  growth events {hook.growth_events}" if hook.growth_events is not None else "")
                                 + (f" (+{grew})" if grew else ""))
        elif node.error is None:
            lines.append("  no hook answered"
                         + (f" on ports {HOOK_PORT_RANGE}" if report.unreachable_default_hooks else ""))
    for key, engine in history.engines.items():
        if not any(node.name == key for node in report.nodes):
            lines.append(f"engine on {key}: {engine.text()}")
    lines.extend(f"engine {url}: unreachable ({why})" for url, why in history.engine_errors.items())
    room = height - len(lines) - 1
    if history.events and room > 1:
        lines.append("events:")
        lines.extend(list(history.events)[-(room - 1):])
    return [printable(line)[:width] for line in lines[:height]]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("The ledger live in the terminal (memtel ledger, every second): headroom and its trend, "
                          "contiguous free memory, the ledger per process, hooked calls and growth events, "
                          "kernel-log errors as they arrive, and a stalled engine (requests running, no progress: "
                          "MemtelEngineStalled's definition). Keys: q quit, p pause, s sort, r refresh.")
    add_sources(parser)
    parser.add_argument("--engines", type=url_list, default=None, metavar="URL[,URL...]",
                        help="the serving engines' /metrics (vLLM's API port), read for requests running and their "
                        f"progress (default: port {DEFAULT_ENGINE_PORT} on each daemon's host, where it answers)")
    parser.add_argument("--interval", type=SECONDS, default=1.0, help="seconds between frames, above 0, at most 60 "
                        "(default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit (dumb terminals, scripts)")


def take_frame(args: argparse.Namespace, timeout: float) -> tuple[LedgerReport, list[Scrape]]:
    """The ledger's report and the engines' /metrics, read side by side within `timeout`. With no --engines,
    only the engines that answer on the default port are kept."""
    hosts = dict.fromkeys(parse_url(u).host for u in args.daemon)
    urls = (args.engines if args.engines is not None
            else [Endpoint("http", h, DEFAULT_ENGINE_PORT, METRICS_PATH).url for h in hosts])
    with ThreadPoolExecutor(max_workers=1) as pool:
        engines = pool.submit(scrape_all, urls, timeout)
        report = take_report(args.daemon, args.hooks, timeout_s=timeout)
        read = engines.result()
    return report, read if args.engines is not None else [e for e in read if e.error is None]


def run(args: argparse.Namespace) -> int:
    dumb = os.environ.get("TERM", "dumb") in ("", "dumb") or not sys.stdout.isatty() or not sys.stdin.isatty()
    timeout = min(1.0, args.interval)
    if args.once or dumb:
        history = History()
        report, engines = take_frame(args, timeout)
        deltas = history.update(report, engines)
        size_ = os.get_terminal_size(sys.stdout.fileno()) if sys.stdout.isatty() else os.terminal_size((80, 200))
        print("\n".join(frame(report, history, deltas, sort=args.sort, paused=False, width=size_.columns,
                              height=10_000, interval=args.interval)))
        return 1 if could_not_read(report) or history.engine_errors else 0
    import curses

    return int(curses.wrapper(_loop, args, timeout))


def _loop(screen: object, args: argparse.Namespace, timeout: float) -> int:
    import curses

    assert isinstance(screen, curses.window)
    curses.curs_set(0)
    screen.timeout(100)
    history = History()
    sorts = sorted(SORTS)
    sort = args.sort
    paused = False
    report: LedgerReport | None = None
    deltas: dict[str, tuple[int | None, int | None]] = {}
    due = 0.0
    while True:
        now = time.monotonic()
        if not paused and now >= due:
            report, engines = take_frame(args, timeout)
            deltas = history.update(report, engines)
            due = now + args.interval
        if report is not None:
            height, width = screen.getmaxyx()
            screen.erase()
            for row, line in enumerate(frame(report, history, deltas, sort=sort, paused=paused,
                                             width=max(1, width - 1), height=height, interval=args.interval)):
                screen.addstr(row, 0, line)
            screen.refresh()
        key = screen.getch()
        if key in (ord("q"), ord("Q"), 27):
            return 0
        if key in (ord("p"), ord("P"), ord(" ")):
            paused = not paused
        elif key in (ord("s"), ord("S")):
            sort = sorts[(sorts.index(sort) + 1) % len(sorts)]
        elif key in (ord("r"), ord("R")):
            due = 0.0


__all__ = ["History", "frame", "take_frame"]
