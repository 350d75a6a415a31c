"""Tables: the harness's standard sections of the report, built from `RunMetrics`.

(1) per-rank allocator growth per arm, and where it happened (first call, last call, per request);
(2) host MemAvailable per request per node, arms side by side; (3) TTFT per request per arm, client and
server side; (4) swap, NV_ERR_NO_MEMORY and Xid per request per node; then failed and skipped requests.
With repeats a cell is `median [min–max]`, and an A−B difference whose ranges overlap is said to be
inside the spread.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from harness.ab.report import markdown as md
from harness.ab.report.markdown import Section, Table
from harness.ab.report.metrics import RankRequestMetrics, RequestMetrics, RunMetrics, Spread

MIB = 1024 * 1024

RequestPick = Callable[[RequestMetrics], float | None]


def node_metric(node: str, name: str) -> RequestPick:
    """A request's `NodeRequestMetrics.<name>` of one node."""
    return lambda m: getattr(m.nodes[node], name)


def rank_metric(rank: str, name: str) -> RequestPick:
    """A request's `RankRequestMetrics.<name>` of one rank."""
    return lambda m: getattr(m.ranks[rank], name)


def header(metrics: RunMetrics) -> str:
    run = metrics.run
    env = run.environment
    lines = [f"# A/B report: {', '.join(run.arms)}", "",
             f"Run directory `{run.run_dir}`; status **{run.status or 'unfinished'}**; "
             f"{len(run.steps)} steps × {run.repeats} repeat(s); order {run.ladder.order}; "
             f"memtel {env.get('memtel_version')} ({env.get('git_revision')}) on {env.get('hostname')}.", ""]
    for arm in run.ladder.arms:
        info = run.servers.get(arm.name)
        version = info.version if info is not None else None
        version = version.get("version") if isinstance(version, dict) else version
        how = " ".join(arm.serve.command) if arm.serve else f"external server {arm.url}"
        env_text = " ".join(f"{k}={v}" for k, v in (arm.serve.env if arm.serve else {}).items())
        lines.append(f"- **{arm.name}**: {env_text + ' ' if env_text else ''}`{how}` (server version {version})")
    return "\n".join(lines)


def allocator_table(metrics: RunMetrics) -> Table:
    run = metrics.run
    rows = []
    for rank in run.ranks:
        for arm in run.arms:
            def over_repeats(pick: Callable[[RankRequestMetrics], float | None], rank: str = rank,
                             arm: str = arm) -> Spread | None:
                return Spread.of([metrics.rank_total(rank, arm, r, pick) for r in range(run.repeats)])

            per_step = [md.spread(metrics.spread(arm, s, rank_metric(rank, "reserved_growth_bytes")),
                                  MIB, sign=True) for s in run.steps]
            rows.append([rank, arm, md.spread(over_repeats(lambda r: r.reserved_growth_bytes), MIB, sign=True),
                         md.spread(over_repeats(lambda r: r.num_device_alloc), digits=0),
                         md.spread(over_repeats(lambda r: r.growth_events), digits=0),
                         md.spread(over_repeats(lambda r: r.hook_calls), digits=0), *per_step])
    return Table(["rank", "arm", "reserved growth (MiB)", "device allocs", "growth events", "hooked calls",
                  *[f"{s} (MiB)" for s in run.steps]], rows)


def hook_location_table(metrics: RunMetrics) -> Table:
    rows = []
    run = metrics.run
    for arm in run.arms:
        for repeat in range(run.repeats):
            ranks = sorted({rank for s in run.steps if (m := metrics.requests.get((arm, repeat, s)))
                            for rank in m.hook})
            for rank in ranks:
                for step in run.steps:
                    m = metrics.requests.get((arm, repeat, step))
                    if m is None or rank not in m.hook:
                        continue
                    loc = m.hook[rank]
                    if not loc.has_allocator:
                        rows.append([f"rank {rank}", arm, str(repeat), step, str(loc.calls), "n/a (no allocator)",
                                     "n/a", "n/a", "n/a"])
                        continue
                    rows.append([f"rank {rank}", arm, str(repeat), step, str(loc.calls),
                                 md.number(loc.reserved_growth_bytes, MIB, sign=True),
                                 md.number(loc.first_call_growth_bytes, MIB, sign=True),
                                 md.number(loc.last_call_growth_bytes, MIB, sign=True),
                                 md.number(loc.num_device_alloc, digits=0)])
    return Table(["rank", "arm", "repeat", "step", "hooked calls", "reserved growth (MiB)", "first call (MiB)",
                  "last call (MiB)", "device allocs"], rows)


def allocator_section(metrics: RunMetrics) -> Section:
    table, location = allocator_table(metrics), hook_location_table(metrics)
    body = ("From the hook exporter, scraped before the first request and after each one; the per-step columns "
            "are the growth during that request. Device allocs: the allocator's `num_device_alloc` (cudaMalloc "
            "calls, or map calls under expandable segments).\n\n"
            + (table.markdown() if table else "_No ranks configured._")
            + "\n\n### Where the growth happened (hook per-call log)\n\n"
            + (location.markdown() if location
               else "_No hook per-call logs in this run (set MEMTEL_TARGETS in the serve env)._"))
    return Section("allocator", "1. Allocator growth per rank", body,
                   data={"hook_growth": [dict(zip(location.header, row, strict=True)) for row in location.rows]})


def mem_available_section(metrics: RunMetrics) -> Section:
    run = metrics.run
    pair = run.arms[:2] if len(run.arms) >= 2 else None
    rows = []
    for step in run.steps:
        for node in run.nodes:
            row = [step, node]
            for arm in run.arms:
                row.append(md.spread(metrics.spread(arm, step, node_metric(node, "mem_available_delta_bytes")),
                                     MIB, sign=True))
                row.append(md.spread(metrics.spread(arm, step,
                                                    node_metric(node, "mem_available_min_delta_bytes")),
                                     MIB, sign=True))
            if pair:
                row.append(md.difference(metrics.difference(
                    pair[0], pair[1], step, node_metric(node, "mem_available_delta_bytes")), MIB, " MiB"))
            rows.append(row)
    head = ["step", "node"]
    for arm in run.arms:
        head += [f"{arm}: Δ after (MiB)", f"{arm}: lowest during (MiB)"]
    if pair:
        head.append(f"{pair[0]} − {pair[1]}")
    table = Table(head, rows)
    return Section("mem_available", "2. Host MemAvailable per request",
                   "Change of MemAvailable from just before the request to just after it, and the lowest point "
                   "during it (node samples), relative to before.\n\n"
                   + (table.markdown() if table else "_No nodes configured._"))


def _prompt_tokens_cell(metrics: RunMetrics, step: str) -> str:
    requests = [m for k, m in metrics.requests.items() if k[2] == step]
    usage = {m.usage_prompt_tokens for m in requests if m.usage_prompt_tokens is not None}
    built = {m.prompt_tokens for m in requests}
    if not usage:
        return "n/a"
    mark = "exact" if usage <= built else f"MISMATCH (built {sorted(built)})"
    return f"{', '.join(f'{u:,}' for u in sorted(usage))} ({mark})"


def _needle_cell(found: list[bool | None]) -> str:
    known = [f for f in found if f is not None]
    return f"{sum(known)}/{len(known)}" if known else "n/a"


def cold_statement(metrics: RunMetrics) -> str:
    """Whether every prefill was cold, from the server's prefix-cache hit counter."""
    known = metrics.cold_checked
    if not known:
        return "Prefix cache: the servers do not export vllm:prefix_cache_hits; coldness not checked."
    warm = [f"{a} r{r} {s} ({v:,.0f} tokens)" for (a, r, s), v in sorted(known.items()) if v > 0]
    if not warm:
        return f"Prefix cache: 0 hit tokens in all {len(known)} requests: every prefill was cold."
    return "Prefix cache HITS (these prefills were not cold): " + ", ".join(warm) + "."


def ttft_section(metrics: RunMetrics) -> Section:
    run = metrics.run
    pair = run.arms[:2] if len(run.arms) >= 2 else None
    rows = []
    for step in run.steps:
        row = [step, _prompt_tokens_cell(metrics, step)]
        for arm in run.arms:
            row += [md.spread(metrics.spread(arm, step, lambda m: m.ttft_client_s), digits=3),
                    md.spread(metrics.spread(arm, step, lambda m: m.ttft_server_s), digits=3),
                    md.spread(metrics.spread(arm, step, lambda m: m.e2e_s), digits=2),
                    _needle_cell(metrics.values(arm, step, lambda m: m.needle_found))]
        if pair:
            row.append(md.difference(metrics.difference(pair[0], pair[1], step, lambda m: m.ttft_client_s), 1.0, " s",
                                     3))
        rows.append(row)
    head = ["step", "prompt tokens (usage)"]
    for arm in run.arms:
        head += [f"{arm}: TTFT client (s)", f"{arm}: TTFT server (s)", f"{arm}: e2e (s)", f"{arm}: needle"]
    if pair:
        head.append(f"{pair[0]} − {pair[1]} TTFT")
    return Section("ttft", "3. Time to first token per request",
                   "Client: request sent to first streamed content; server: vllm:time_to_first_token_seconds "
                   "(sum/count deltas around the request).\n\n" + Table(head, rows).markdown() + "\n\n"
                   + cold_statement(metrics))


def swap_section(metrics: RunMetrics) -> Section:
    run = metrics.run
    rows = []
    for step in run.steps:
        for node in run.nodes:
            row = [step, node]
            for arm in run.arms:
                def cell(pick: RequestPick, scale: float = 1.0, digits: int = 0,
                         arm: str = arm, step: str = step) -> str:
                    return md.spread(metrics.spread(arm, step, pick), scale, digits)

                row += [cell(node_metric(node, "pswpin")) + " / " + cell(node_metric(node, "pswpout")),
                        cell(node_metric(node, "max_swap_used_bytes"), MIB, 1),
                        cell(node_metric(node, "nv_err_no_memory")),
                        cell(node_metric(node, "xid"))]
            rows.append(row)
    head = ["step", "node"]
    for arm in run.arms:
        head += [f"{arm}: swap in / out (pages)", f"{arm}: max swap used (MiB)", f"{arm}: NV_ERR_NO_MEMORY",
                 f"{arm}: Xid"]
    table = Table(head, rows)
    return Section("swap", "4. Swap and driver errors per request",
                   table.markdown() if table else "_No nodes configured._")


def failures_section(metrics: RunMetrics) -> Section:
    lines = []
    for f in metrics.failures:
        if f.kind == "not run":
            lines.append(f"- {f.arm} r{f.repeat} {f.step}: not run yet (resume with "
                         "`memtel ab run LADDER --out DIR --resume`)")
        else:
            lines.append(f"- {f.arm} r{f.repeat} {f.step}: {f.kind}: {f.reason}")
    return Section("failures", "Failed and skipped requests",
                   "\n".join(lines) if lines else "None: every request of every arm completed.")


def plots_section(plots: list[Path]) -> Section:
    return Section("plots", "Plots", "\n".join(f"![{p.stem}](plots/{p.name})" for p in plots),
                   data=[f"plots/{p.name}" for p in plots])


def standard_sections(metrics: RunMetrics) -> list[Section]:
    """The harness's own sections, in order (the plots section is added when the plots are drawn)."""
    return [allocator_section(metrics), mem_available_section(metrics), ttft_section(metrics), swap_section(metrics),
            failures_section(metrics)]


__all__ = ["allocator_table", "cold_statement", "header", "hook_location_table", "standard_sections"]
