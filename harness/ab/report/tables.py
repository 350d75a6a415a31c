"""Tables: the harness's standard sections of the report, built from `RunMetrics`.

The header (the verdict line first, then the run and each arm's command and expanded environment); the run's
history when a block was resumed or restarted; (1) per-rank allocator growth per arm, and where it happened
(first call, last call, per request); (2) host MemAvailable per request per node, arms side by side; (3) TTFT
per request per arm, client and server side; (4) swap, NV_ERR_NO_MEMORY and Xid per request per node; (5) the
statistics (harness/ab/report/comparisons.py); then failed and skipped requests, and the plots with what the
reader needs next to them. With repeats a cell is `median [min–max]`; an A − B column is the paired
difference with what it says (significant, within the noise, ...). Every `n/a` is explained under its table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from harness.ab.report import markdown as md
from harness.ab.report.comparisons import statistics_section
from harness.ab.report.markdown import Section, Table
from harness.ab.report.metrics import RankRequestMetrics, RequestMetrics, RunMetrics, Spread
from telemetry import hook_env
from telemetry.catalogue import vllm
from telemetry.catalogue.fields import NODE_SNAPSHOT_SERIES
from telemetry.url import redact_credentials

MIB = 1024 * 1024

RequestPick = Callable[[RequestMetrics], float | None]


def node_metric(node: str, name: str) -> RequestPick:
    """A request's `NodeRequestMetrics.<name>` of one node."""
    return lambda m: getattr(m.nodes[node], name)


def rank_metric(rank: str, name: str) -> RequestPick:
    """A request's `RankRequestMetrics.<name>` of one rank."""
    return lambda m: getattr(m.ranks[rank], name)


def header(metrics: RunMetrics, verdict_line: str = "") -> str:
    run = metrics.run
    env = run.environment
    lines = [f"# A/B report: {', '.join(run.arms)}", ""]
    if verdict_line:
        lines += [verdict_line, ""]
    lines += [f"Run directory `{run.run_dir}`; status **{run.status or 'unfinished'}**; "
              f"{len(run.steps)} steps × {run.repeats} repeat(s); order {run.ladder.order}; "
              f"memtel {env.get('memtel_version')} ({env.get('git_revision')}) on {env.get('hostname')}.", ""]
    cost = harness_cost(metrics)
    if cost:
        lines += [cost, ""]
    for arm in run.ladder.arms:
        info = run.servers.get(arm.name)
        version = info.version if info is not None else None
        version = version.get("version") if isinstance(version, dict) else version
        lines.append(f"- **{arm.name}**: {_arm_how(metrics, arm.name)} (server version {version})")
    return "\n".join(lines)


def _arm_how(metrics: RunMetrics, name: str) -> str:
    """The arm's command and environment as the harness ran them (templates expanded), from its serve records."""
    run = metrics.run
    arm = next(a for a in run.ladder.arms if a.name == name)
    from harness.ab.redact import redact_argv, redact_env

    if arm.serve is None:
        return f"external server {redact_credentials(arm.url)}"
    serves = [s for r in range(run.repeats) for s in run.serves.get((name, r), ())]
    first = serves[0] if serves else None
    env = first.env if first is not None else arm.serve.env
    command = first.command if first is not None else list(arm.serve.command)
    # Redacted again (records of older versions held secrets): harness/ab/redact.py.
    env_text = " ".join(f"{k}={v}" for k, v in redact_env(env).items())
    text = f"{'`' + env_text + '` ' if env_text else ''}`{' '.join(redact_argv(command))}`"
    if first is not None and any(s.env != first.env for s in serves):
        text += f" (environment of repeat {first.repeat}'s serve; each repeat gets its own values)"
    elif first is None and env:
        text += " (the ladder's environment: no serve was recorded)"
    return text


def harness_cost(metrics: RunMetrics) -> str:
    """What the harness process itself used (the last `memtel ab run`), and what building the prompts took."""
    run = metrics.run
    parts = []
    end = run.run_end
    if end is not None and end.cpu_s is not None and end.max_rss_bytes is not None:
        parts.append(f"{end.cpu_s:,.1f} s CPU, peak RSS {end.max_rss_bytes / MIB:,.0f} MiB (the harness's process, "
                     f"its last run; servers not included)")
    prompts = list(run.prompts.values())
    if prompts:
        calls = sum(p.tokenize_calls for p in prompts)
        waited = [p.tokenize_s for p in prompts if p.tokenize_s is not None]
        most = max(p.tokenize_calls for p in prompts)
        text = f"{len(prompts)} prompts built with {calls} `/tokenize` calls (at most {most} per prompt"
        text += f", {sum(waited):,.1f} s waiting for them)" if waited else ")"
        parts.append(text)
    return ("Harness: " + "; ".join(parts) + ".") if parts else ""


def na_notes(metrics: RunMetrics, part: str, fields: Sequence[str], absent: str) -> str:
    """Why cells of a table read n/a: which exporter did not answer (with its URL and error), which one does not
    export the series, and failed requests. `part`: "nodes" or "ranks"."""
    run = metrics.run
    reasons: dict[str, list[str]] = {}
    for m in metrics.ordered():
        if not m.ok:
            continue
        arm = next((a for a in run.ladder.arms if a.name == m.arm), None)
        urls = run.ladder.nodes if part == "nodes" else (run.ladder.ranks_for(arm) if arm else {})
        items = m.nodes if part == "nodes" else m.ranks
        for name, item in items.items():
            what = f"{'node' if part == 'nodes' else 'rank'} {name} ({urls.get(name, 'no URL for this arm')})"
            if item.error:
                reason = f"{what} did not answer: {item.error[:200]}"
            elif all(getattr(item, f) is None for f in fields):
                reason = f"{what} {absent}"
            else:
                continue
            reasons.setdefault(reason, []).append(f"{m.arm} repeat {m.repeat} {m.step}")
    lines = [f"- n/a: {reason} ({_requests_text(who)})" for reason, who in reasons.items()]
    if any(f.kind in ("failed", "skipped") for f in metrics.failures):
        lines.append("- n/a where no request of the step succeeded: see \"Failed and skipped requests\"")
    return "\n".join(lines)


def _requests_text(who: list[str]) -> str:
    if len(who) <= 3:
        return ", ".join(who)
    return f"{len(who)} requests: {', '.join(who[:2])}, …"


def _with_notes(text: str, notes: str) -> str:
    return text + ("\n\n" + notes if notes else "")


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


def hook_growth_data(metrics: RunMetrics) -> list[dict]:
    """The hook's per-call growth per (rank, arm, repeat, step) as numbers, for summary.json."""
    out = []
    for m in metrics.ordered():
        for rank, loc in sorted(m.hook.items()):
            out.append({"rank": rank, "arm": m.arm, "repeat": m.repeat, "step": m.step, "hooked_calls": loc.calls,
                        "has_allocator": loc.has_allocator, "reserved_growth_bytes": loc.reserved_growth_bytes,
                        "first_call_growth_bytes": loc.first_call_growth_bytes,
                        "last_call_growth_bytes": loc.last_call_growth_bytes,
                        "num_device_alloc": loc.num_device_alloc})
    return out


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
    notes = na_notes(metrics, "ranks", ("reserved_before_bytes", "reserved_after_bytes", "reserved_growth_bytes"),
                     "exports no allocator series (no CUDA allocator in the hooked process, or the hook is not in it)")
    body = ("From the hook exporter, scraped before the first request and after each one; the per-step columns "
            "are the growth during that request. Device allocs: the allocator's `num_device_alloc` (cudaMalloc "
            "calls, or map calls under expandable segments).\n\n"
            + (_with_notes(table.markdown(), notes) if table else "_No ranks configured._")
            + "\n\n### Where the growth happened (hook per-call log)\n\n"
            + (location.markdown() if location
               else f"_No hook per-call logs in this run (set {hook_env.TARGETS} in the serve env)._"))
    return Section("allocator", "1. Allocator growth per rank", body, data={"hook_growth": hook_growth_data(metrics)})


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
                row.append(md.difference(metrics.paired(
                    pair[0], pair[1], step, node_metric(node, "mem_available_min_delta_bytes")), MIB, " MiB"))
            rows.append(row)
    head = ["step", "node"]
    for arm in run.arms:
        head += [f"{arm}: Δ after (MiB)", f"{arm}: lowest during (MiB)"]
    if pair:
        head.append(f"{pair[0]} − {pair[1]}: lowest during")
    table = Table(head, rows)
    notes = na_notes(metrics, "nodes", ("mem_available_delta_bytes", "mem_available_min_delta_bytes"),
                     f"exports no {NODE_SNAPSHOT_SERIES['mem_available_bytes']}")
    return Section("mem_available", "2. Host MemAvailable per request",
                   "Change of MemAvailable from just before the request to just after it, and the lowest point "
                   "during it (node samples), relative to before.\n\n"
                   + (_with_notes(table.markdown(), notes) if table else "_No nodes configured._"))


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
        return f"Prefix cache: the servers do not export {vllm.PREFIX_CACHE_HITS.name}; coldness not checked."
    warm = [f"{a} repeat {r} {s} ({v:,.0f} tokens)" for (a, r, s), v in sorted(known.items()) if v > 0]
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
            row.append(md.difference(metrics.paired(pair[0], pair[1], step, lambda m: m.ttft_client_s), 1.0, " s", 3))
        rows.append(row)
    head = ["step", "prompt tokens (usage)"]
    for arm in run.arms:
        head += [f"{arm}: TTFT client (s)", f"{arm}: TTFT server (s)", f"{arm}: e2e (s)", f"{arm}: needle"]
    if pair:
        head.append(f"{pair[0]} − {pair[1]} TTFT")
    no_server_ttft = sorted({m.arm for m in metrics.requests.values() if m.ok and m.ttft_server_s is None})
    notes = [cold_statement(metrics)]
    if no_server_ttft:
        notes.append(f"TTFT server n/a for {', '.join(no_server_ttft)}: its server's /metrics had no "
                     f"{vllm.TIME_TO_FIRST_TOKEN.name}, or did not answer, around those requests.")
    return Section("ttft", "3. Time to first token per request",
                   f"Client: request sent to first streamed content; server: {vllm.TIME_TO_FIRST_TOKEN.name} "
                   "(sum/count deltas around the request).\n\n" + Table(head, rows).markdown() + "\n\n"
                   + "\n\n".join(notes))


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
    swap, kernel = (", ".join(NODE_SNAPSHOT_SERIES[f"{k}_total"] for k in keys)
                    for keys in (("pswpin", "pswpout"), ("nv_err_no_memory", "xid")))
    notes = na_notes(metrics, "nodes", ("pswpin", "pswpout", "nv_err_no_memory", "xid"),
                     f"exports no swap ({swap}) or kernel-log ({kernel}) counters")
    return Section("swap", "4. Swap and driver errors per request",
                   _with_notes(table.markdown(), notes) if table else "_No nodes configured._")


def failures_section(metrics: RunMetrics) -> Section:
    lines = []
    for f in metrics.failures:
        if f.kind == "not run":
            lines.append(f"- {f.arm} repeat {f.repeat} {f.step}: not run yet (resume with "
                         "`memtel ab run LADDER --out DIR --resume`)")
        else:
            lines.append(f"- {f.arm} repeat {f.repeat} {f.step}: {f.kind}: {f.reason}")
    return Section("failures", "Failed and skipped requests",
                   "\n".join(lines) if lines else "None: every request of every arm completed.")


def history_section(metrics: RunMetrics) -> Section | None:
    """What was resumed (superseded block attempts) and which blocks ran on more than one server."""
    run = metrics.run
    lines = []
    for s in run.superseded:
        done = f"its records of {', '.join(s.steps)} are superseded" if s.steps else "no step had finished"
        lines.append(f"- {s.arm} repeat {s.repeat}: {s.reason}; {done} (kept in results.jsonl, not counted here).")
    for (arm, repeat), serves in sorted(run.serves.items()):
        if len(serves) > 1:
            lines.append(f"- {arm} repeat {repeat}: {len(serves)} servers in one attempt (the server died and "
                         "`on_error: continue` started a fresh one): requests after the restart ran on a cold "
                         "allocator, unlike the block's other requests.")
    if not lines:
        return None
    intro = (f"The run was resumed {run.resumes} time(s). A block (a fresh serve, then every step in order) is the "
             "unit of an A/B: a resumed block runs again from its first step, so every number here comes from one "
             "uninterrupted block." if run.resumes else "")
    data = {"resumes": run.resumes, "superseded": [{"arm": s.arm, "repeat": s.repeat, "steps": s.steps,
                                                   "reason": s.reason} for s in run.superseded],
            "serves_per_block": {f"{arm}/{repeat}": len(serves)
                                 for (arm, repeat), serves in sorted(run.serves.items())}}
    return Section("history", "Run history", "\n\n".join(x for x in (intro, "\n".join(lines)) if x),
                   placement="lead", data=data)


def hooked_calls_note(metrics: RunMetrics) -> str:
    """Next to the reserved-per-call plots: why the arms' lines end at different x when their call counts differ."""
    # The calls inside the requests' windows, as the tables count them (a call log also holds calls made outside
    # any request, such as a rank's warm-up: counting the whole log gave one call more than the tables).
    totals: dict[str, int] = {}
    for arm in metrics.run.arms:
        per_rank: dict[int, int] = {}
        for m in metrics.requests.values():
            if m.arm == arm and m.repeat == 0:
                for rank, location in m.hook.items():
                    per_rank[rank] = per_rank.get(rank, 0) + location.calls
        if per_rank:
            totals[arm] = max(per_rank.values())
    if len(set(totals.values())) < 2:
        return ""
    counts = ", ".join(f"{arm} {n:,}" for arm, n in totals.items())
    return (f"The x-axis counts hooked calls, and the arms made different numbers of them during the requests "
            f"(repeat 0, busiest rank: {counts}), so their lines end at different x. Where the hooked function is "
            "the indexer's logits launch, each launch holds at most the logits budget: an arm with wider logits "
            "(fixed: the padded width from the first chunk on) splits a chunk's rows into more, narrower launches, "
            "so it makes more calls for the same tokens. Compare the arms request by request (the tables above), "
            "not call by call.")


def plots_section(plots: list[Path], captions: dict[str, str] | None = None) -> Section:
    captions = captions or {}
    lines = []
    for p in plots:
        lines.append(f"![{p.stem}](plots/{p.name})")
        if captions.get(p.name):
            lines.append(f"\n{captions[p.name]}\n")
    return Section("plots", "Plots", "\n".join(lines), data=[f"plots/{p.name}" for p in plots])


def plot_captions(metrics: RunMetrics, plots: list[Path]) -> dict[str, str]:
    note = hooked_calls_note(metrics)
    captions = {}
    for p in plots:
        if p.name.startswith("reserved_rank") and note:
            captions[p.name] = note
        elif p.name.startswith("mem_available_"):
            captions[p.name] = ("One panel per step: MemAvailable minus its value just before the request (the "
                                "node's last scrape), so background drift between requests does not look like a "
                                "difference between the arms.")
    return captions


def standard_sections(metrics: RunMetrics) -> list[Section]:
    """The harness's own sections, in order (the plots section is added when the plots are drawn)."""
    return [allocator_section(metrics), mem_available_section(metrics), ttft_section(metrics), swap_section(metrics),
            statistics_section(metrics), failures_section(metrics)]


__all__ = ["allocator_table", "cold_statement", "harness_cost", "header", "history_section", "hook_growth_data",
           "hook_location_table", "hooked_calls_note", "na_notes", "plot_captions", "plots_section",
           "standard_sections"]
