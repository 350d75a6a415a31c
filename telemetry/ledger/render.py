"""The ledger as text: one block per node (its lines, headroom, kernel errors), then a row per process.

Shared by `memtel ledger` and `memtel top`, so both show the same lines under the same names. Fits 80
columns. Unknown values print as `?`, never as 0; what could not be reached says so, with the reason. Every
endpoint is untrusted: what it sent (a label, a pid, its error) is cut and its control characters escaped
(telemetry.errors.printable) before a line is returned, so nothing it sends moves the cursor or retitles a terminal.
"""

from __future__ import annotations

from collections.abc import Callable

from telemetry.errors import printable
from telemetry.ledger.scrape import NOT_A_DAEMON, HookView, LedgerReport, NodeView
from telemetry.scrape.ports import HOOK_PORT_RANGE

NAME_CHARS = 64    # a node's name from a label, in a title
CELL_CHARS = 12    # a rank or pid from a label, in a column
URL_CHARS = 120    # a URL as given
GiB = float(1 << 30)
MiB = float(1 << 20)

NODE_TITLES = {"gpu_processes": "GPU processes", "page_cache": "page cache", "other_host": "other host",
               "unexplained": "unexplained"}
SORTS: dict[str, Callable[[HookView], tuple[int, ...]]] = {
    "rank": lambda h: (int(h.process is None), int(h.process.rank) if h.process and h.process.rank.isascii()
                       and h.process.rank.isdigit() and len(h.process.rank) < 10 else 0),
    "reserved": lambda h: (-(h.process.reserved or 0) if h.process else 0,),
    "outside": lambda h: (-(h.process.outside or 0) if h.process else 0,),
    "rss": lambda h: (-(h.process.host_rss or 0) if h.process else 0,),
}


def size(value: int | None) -> str:
    if value is None:
        return "?"
    if abs(value) >= GiB:
        return f"{value / GiB:.2f}G"
    if abs(value) >= MiB:
        return f"{value / MiB:.0f}M"
    return f"{value / 1024:.0f}K"


def node_block(node: NodeView) -> list[str]:
    title = f"node {printable(node.name, NAME_CHARS)}" + (f" ({printable(node.daemon_url, URL_CHARS)})"
                                                         if node.daemon_url else "")
    if node.error is not None:
        unreachable = node.daemon_url and node.error != NOT_A_DAEMON
        lines = [title, f"  daemon unreachable: {node.error}" if unreachable else f"  {node.error}"]
    else:
        lines = [title]
        ledger = node.ledger
        if ledger is not None:
            unified = {True: "unified memory", False: "discrete GPU", None: "no NVML"}[ledger.unified]
            lines.append(f"  host used {size(ledger.used)} of {size(ledger.total)} ({unified})")
            lines.append("   " + "  ".join(f"{title_} {size(value)}" for key, title_ in NODE_TITLES.items()
                                          if (value := ledger.lines()[key]) is not None or key != "gpu_processes"))
        lines.append(f"  headroom {size(node.headroom)}  contiguous free {size(node.contiguous_free)}  "
                     f"MemAvailable {size(node.mem_available)}")
        if node.kernel_errors:
            lines.append("  kernel log: " + ", ".join(f"{k} {v}" for k, v in sorted(node.kernel_errors.items())))
    return lines


PROCESS_HEADER = (f"  {'rank':>4} {'pid':>7} {'weights':>7} {'KV':>7} {'graphs':>6} {'live':>7} {'cache':>6} "
                  f"{'outside':>8} {'RSS':>6} {'fit':>9}")


def process_row(hook: HookView) -> str:
    if hook.error is not None:
        return f"  hook {printable(hook.url, URL_CHARS)}: unreachable ({hook.error})"
    p = hook.process
    if p is None:
        return f"  hook {printable(hook.url, URL_CHARS)}: no rank or engine series"
    outside = size(p.outside) + ("*" if p.outside_basis == "device_used" else "")
    fit = "?" if hook.max_prefill_tokens is None else f"{hook.max_prefill_tokens:,}"
    rank, pid = printable(p.rank, CELL_CHARS) or "?", printable(p.pid, CELL_CHARS) or "?"
    return (f"  {rank:>4} {pid:>7} {size(p.weights):>7} {size(p.kv_cache):>7} "
            f"{size(p.cuda_graph_pool):>6} {size(p.live_other):>7} {size(p.allocator_cache):>6} {outside:>8} "
            f"{size(p.host_rss):>6} {fit:>9}")


def render(report: LedgerReport, sort: str = "rank") -> list[str]:
    lines: list[str] = []
    for node in report.nodes:
        lines.extend(node_block(node))
        if node.hooks:
            lines.append(PROCESS_HEADER)
            lines.extend(process_row(h) for h in sorted(node.hooks, key=SORTS[sort]))
        elif node.error is None:
            lines.append("  no hook answered"
                         + (f" on ports {HOOK_PORT_RANGE}" if report.unreachable_default_hooks else ""))
    if any(h.process is not None and h.process.outside_basis == "device_used"
           for n in report.nodes for h in n.hooks):
        lines.append("* outside from the device's used bytes (all its processes): NVML lists no such pid")
    lines.append("live = allocated - weights - KV   cache = reserved - allocated   ? = unknown")
    lines.append("outside = the process's GPU memory - reserved   fit = longest prefill that fits")
    return [printable(line) for line in lines]


__all__ = ["SORTS", "render", "size"]
