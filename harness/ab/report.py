"""The comparison report of a run directory: report.md, summary.json and PNG plots.

Reads only results.jsonl and the hook's per-call logs, so a report can be rewritten at any time,
also for a run that is still going or was interrupted. The four tables of the issue:
(1) per-rank allocator growth per arm, and where it happened (first chunk, per step, last chunk);
(2) host MemAvailable delta per request per node, arms side by side; (3) TTFT per request per arm,
client and server side; (4) swap, NV_ERR_NO_MEMORY and Xid per request per node. With repeats a cell
is `median [min–max]`, and an A−B difference whose ranges overlap is said to be inside the spread.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from harness.ab.records import RESULTS_FILE, read_records

MIB = 1024 * 1024


@dataclass
class _Run:
    ladder: dict
    arms: list[str]
    steps: list[str]
    repeats: int
    nodes: list[str]
    ranks: list[str]
    requests: dict = field(default_factory=dict)        # (arm, repeat, step) -> request record
    skipped: dict = field(default_factory=dict)         # (arm, repeat, step) -> reason
    scrapes: dict = field(default_factory=lambda: defaultdict(list))   # (arm, repeat) -> scrapes by time
    samples: dict = field(default_factory=lambda: defaultdict(list))   # (arm, repeat, node) -> node samples
    prompts: dict = field(default_factory=dict)         # (step, repeat) -> prompt record
    hook_dirs: dict = field(default_factory=lambda: defaultdict(set))  # (arm, repeat) -> dirs
    stops: list = field(default_factory=list)
    run_end: str | None = None
    environment: dict = field(default_factory=dict)
    servers: dict = field(default_factory=dict)         # arm -> server_info
    run_dir: Path = Path(".")


def load_run(run_dir: Path) -> _Run:
    results = Path(run_dir) / RESULTS_FILE
    if not results.exists():
        raise FileNotFoundError(f"{results} does not exist: not a run directory of `memtel ab run`")
    records = read_records(results)
    starts = [r for r in records if r["event"] == "run_start"]
    if not starts:
        raise FileNotFoundError(f"{results} has no run_start record")
    ladder = starts[0]["ladder"]
    arms = [a["name"] for a in ladder["arms"]]
    all_ranks = dict(ladder.get("ranks") or {})
    for arm in ladder["arms"]:
        all_ranks.update(arm.get("ranks") or {})
    run = _Run(ladder=ladder, arms=arms, steps=[s["label"] for s in ladder["steps"]], repeats=ladder["repeats"],
               nodes=list(ladder.get("nodes") or {}), ranks=list(all_ranks), environment=starts[0]["environment"],
               run_dir=Path(run_dir))
    for arm in ladder["arms"]:
        if arm.get("hook_log_dir"):
            for r in range(run.repeats):
                run.hook_dirs[(arm["name"], r)].add(arm["hook_log_dir"])
    for r in records:
        event = r["event"]
        if event == "request":
            run.requests[(r["arm"], r["repeat"], r["step"])] = r
            run.skipped.pop((r["arm"], r["repeat"], r["step"]), None)
        elif event == "step_skipped":
            run.skipped[(r["arm"], r["repeat"], r["step"])] = r["reason"]
        elif event == "scrape":
            run.scrapes[(r["arm"], r["repeat"])].append(r)
        elif event == "node_sample":
            run.samples[(r["arm"], r["repeat"], r["node"])].append(r)
        elif event == "prompt":
            run.prompts[(r["step"], r["repeat"])] = r
        elif event == "serve_start" and r.get("hook_log_dir"):
            run.hook_dirs[(r["arm"], r["repeat"])].add(r["hook_log_dir"])
        elif event == "arm_stopped":
            run.stops.append(r)
        elif event == "run_end":
            run.run_end = r["status"]
        elif event == "server_info":
            run.servers.setdefault(r["arm"], r)
    return run


# --- per-request numbers ---

def _scrape_before(run: _Run, arm: str, repeat: int, started_at: float) -> dict | None:
    before = [s for s in run.scrapes[(arm, repeat)] if s["ts"] <= started_at]
    return before[-1] if before else None


def _scrape_after(run: _Run, arm: str, repeat: int, step: str) -> dict | None:
    after = [s for s in run.scrapes[(arm, repeat)] if s["phase"] == "after" and s["step"] == step]
    return after[-1] if after else None


def _delta(after: dict | None, before: dict | None, key: str) -> float | None:
    if not after or not before or after.get(key) is None or before.get(key) is None:
        return None
    return after[key] - before[key]


def request_metrics(run: _Run, arm: str, repeat: int, step: str) -> dict | None:
    """Everything the tables show for one request, from its record and the scrapes around it."""
    req = run.requests.get((arm, repeat, step))
    if req is None:
        return None
    before = _scrape_before(run, arm, repeat, req["started_at"]) or {}
    after = _scrape_after(run, arm, repeat, step) or {}
    out: dict = {
        "arm": arm, "repeat": repeat, "step": step, "ok": req["ok"], "error": req.get("error"),
        "ttft_client_s": req.get("ttft_s"), "ttft_server_s": req.get("server_ttft_s"), "e2e_s": req.get("e2e_s"),
        "prompt_tokens_expected": req.get("prompt_token_count"), "prompt_tokens_usage": req.get("prompt_tokens"),
        "prompt_tokens_match": req.get("prompt_tokens_match"), "output_tokens": req.get("output_tokens"),
        "needle_found": req.get("needle_found"), "started_at": req["started_at"], "ended_at": req["ended_at"],
        "prefix_cache_hit_tokens": req.get("prefix_cache_hit_tokens"),
        "nodes": {}, "ranks": {},
    }
    for node in run.nodes:
        b, a = (before.get("nodes") or {}).get(node), (after.get("nodes") or {}).get(node)
        low = (req.get("min_mem_available_bytes") or {}).get(node)
        start = b.get("mem_available_bytes") if b else None
        lows = [v for v in (low, a.get("mem_available_bytes") if a else None) if v is not None]
        out["nodes"][node] = {
            "mem_available_delta_bytes": _delta(a, b, "mem_available_bytes"),
            "mem_available_min_delta_bytes": (min(lows) - start) if lows and start is not None else None,
            "swap_used_delta_bytes": _delta(a, b, "swap_used_bytes"),
            "max_swap_used_bytes": (req.get("max_swap_used_bytes") or {}).get(node),
            "pswpin": _delta(a, b, "pswpin_total"), "pswpout": _delta(a, b, "pswpout_total"),
            "nv_err_no_memory": _delta(a, b, "nv_err_no_memory_total"), "xid": _delta(a, b, "xid_total"),
            "error": (a or {}).get("error") or (b or {}).get("error"),
        }
    for rank in run.ranks:
        b, a = (before.get("ranks") or {}).get(rank), (after.get("ranks") or {}).get(rank)
        out["ranks"][rank] = {
            "reserved_before_bytes": (b or {}).get("reserved_bytes"), "reserved_after_bytes": (a or {}).get("reserved_bytes"),
            "reserved_growth_bytes": _delta(a, b, "reserved_bytes"),
            "device_allocs": _delta(a, b, "device_alloc_total"),
            "growth_events": _delta(a, b, "growth_events_total"), "hook_calls": _delta(a, b, "hook_calls_total"),
            "error": (a or {}).get("error") or (b or {}).get("error"),
        }
    return out


# --- the hook's per-call logs ---

def load_hook_calls(run: _Run, arm: str, repeat: int) -> dict[int, list[dict]]:
    """rank -> calls sorted by time, from every per-call log file of this block's hook directories."""
    calls: dict[int, list[dict]] = defaultdict(list)
    for directory in run.hook_dirs.get((arm, repeat), ()):
        directory = Path(directory) if Path(directory).is_absolute() else run.run_dir / directory
        for path in sorted(directory.glob("memtel-calls-rank*-pid*.jsonl")):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                calls[int(record.get("rank", 0))].append(record)
    for rank_calls in calls.values():
        rank_calls.sort(key=lambda c: (c.get("ts", 0), c.get("call", 0)))
    return dict(calls)


def growth_location(calls: list[dict], started_at: float, ended_at: float) -> dict:
    """Reserved growth and device allocations in a request's window: first call, last call, all calls."""
    inside = [i for i, c in enumerate(calls) if started_at <= c.get("ts", 0) <= ended_at]
    out = {"calls": len(inside), "reserved_growth_bytes": None, "first_call_growth_bytes": None,
           "last_call_growth_bytes": None, "device_allocs": None, "has_allocator": False}
    if not inside or "reserved_bytes" not in calls[inside[0]]:
        return out

    def growth(i: int, key: str) -> float | None:
        """The change during call i; None for a process's first call (its state before is unknown)."""
        previous = calls[i - 1].get(key) if i > 0 and calls[i - 1].get("pid") == calls[i].get("pid") else None
        return calls[i][key] - previous if previous is not None and key in calls[i] else None

    def total(key: str) -> float | None:
        known = [g for g in (growth(i, key) for i in inside) if g is not None]
        return sum(known) if known else None

    out.update(
        has_allocator=True,
        reserved_growth_bytes=total("reserved_bytes"),
        first_call_growth_bytes=growth(inside[0], "reserved_bytes"),
        last_call_growth_bytes=growth(inside[-1], "reserved_bytes"),
        device_allocs=total("num_device_alloc"),
    )
    return out


# --- formatting ---

def _stats(values: list) -> tuple | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values), len(values)


def _fmt(values: list, scale: float = 1.0, digits: int = 1, sign: bool = False, unit: str = "") -> str:
    s = _stats(values)
    if s is None:
        return "n/a"
    fmt = f"{{:{'+' if sign else ''},.{digits}f}}"
    median, low, high, n = s[0] / scale, s[1] / scale, s[2] / scale, s[3]
    if n == 1:
        return fmt.format(median) + unit
    return f"{fmt.format(median)} [{fmt.format(low)}–{fmt.format(high)}]{unit}"


def _spread_note(a: list, b: list, scale: float, unit: str, digits: int = 1) -> str:
    """The A−B median difference, and whether it is inside the spread of the repeats."""
    sa, sb = _stats(a), _stats(b)
    if sa is None or sb is None:
        return "n/a"
    diff = (sa[0] - sb[0]) / scale
    text = f"{diff:+,.{digits}f}{unit}"
    if sa[3] > 1 and sb[3] > 1 and sa[1] <= sb[2] and sb[1] <= sa[2]:
        text += " (inside the spread)"
    return text


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# --- the report ---

def write_report(run_dir: str | Path) -> Path:
    """Write report.md, summary.json and plots/*.png for a run directory; returns report.md's path."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    metrics = {key: request_metrics(run, *key) for key in run.requests}
    hook = {(arm, r): load_hook_calls(run, arm, r) for arm in run.arms for r in range(run.repeats)}

    def values(arm: str, step: str, pick) -> list:
        out = []
        for r in range(run.repeats):
            m = metrics.get((arm, r, step))
            if m is not None and m["ok"]:
                out.append(pick(m))
        return out

    pair = run.arms[:2] if len(run.arms) >= 2 else None
    sections = [_header(run, run_dir)]

    # (1) per-rank allocator growth
    rows, location_rows = [], []
    for rank in run.ranks:
        for arm in run.arms:
            growth, allocs, events, calls = [], [], [], []
            for r in range(run.repeats):
                ms = [metrics.get((arm, r, s)) for s in run.steps]
                ms = [m for m in ms if m is not None]
                if not ms:
                    continue
                g = [m["ranks"][rank]["reserved_growth_bytes"] for m in ms]
                growth.append(sum(x for x in g if x is not None) if any(x is not None for x in g) else None)
                a = [m["ranks"][rank]["device_allocs"] for m in ms]
                allocs.append(sum(x for x in a if x is not None) if any(x is not None for x in a) else None)
                e = [m["ranks"][rank]["growth_events"] for m in ms]
                events.append(sum(x for x in e if x is not None) if any(x is not None for x in e) else None)
                c = [m["ranks"][rank]["hook_calls"] for m in ms]
                calls.append(sum(x for x in c if x is not None) if any(x is not None for x in c) else None)
            per_step = [_fmt(values(arm, s, lambda m, s=s: m["ranks"][rank]["reserved_growth_bytes"]), MIB, sign=True)
                        for s in run.steps]
            rows.append([rank, arm, _fmt(growth, MIB, sign=True), _fmt(allocs, digits=0), _fmt(events, digits=0),
                         _fmt(calls, digits=0), *per_step])
    table1 = _table(["rank", "arm", "reserved growth (MiB)", "cudaMallocs", "growth events", "hooked calls",
                     *[f"{s} (MiB)" for s in run.steps]], rows) if rows else "_No ranks configured._"
    for arm in run.arms:
        for r in range(run.repeats):
            for rank_id, calls in sorted(hook[(arm, r)].items()):
                for s in run.steps:
                    m = metrics.get((arm, r, s))
                    if m is None:
                        continue
                    loc = growth_location(calls, m["started_at"], m["ended_at"])
                    if not loc["has_allocator"]:
                        location_rows.append([f"rank {rank_id}", arm, r, s, loc["calls"], "n/a (no allocator)", "n/a", "n/a", "n/a"])
                        continue
                    location_rows.append([f"rank {rank_id}", arm, r, s, loc["calls"],
                                          _fmt([loc["reserved_growth_bytes"]], MIB, sign=True),
                                          _fmt([loc["first_call_growth_bytes"]], MIB, sign=True),
                                          _fmt([loc["last_call_growth_bytes"]], MIB, sign=True),
                                          _fmt([loc["device_allocs"]], digits=0)])
    location = (_table(["rank", "arm", "repeat", "step", "hooked calls", "reserved growth (MiB)", "first call (MiB)",
                        "last call (MiB)", "cudaMallocs"], location_rows)
                if location_rows else "_No hook per-call logs in this run (set MEMTEL_TARGETS in the serve env)._")
    sections.append("## 1. Allocator growth per rank\n\nFrom the hook exporter, scraped before the first request "
                    "and after each one; the per-step columns are the growth during that request.\n\n" + table1
                    + "\n\n### Where the growth happened (hook per-call log)\n\n" + location)

    # (2) MemAvailable deltas
    rows = []
    for s in run.steps:
        for node in run.nodes:
            row = [s, node]
            for arm in run.arms:
                row.append(_fmt(values(arm, s, lambda m: m["nodes"][node]["mem_available_delta_bytes"]), MIB, sign=True))
                row.append(_fmt(values(arm, s, lambda m: m["nodes"][node]["mem_available_min_delta_bytes"]), MIB, sign=True))
            if pair:
                row.append(_spread_note(values(pair[0], s, lambda m: m["nodes"][node]["mem_available_delta_bytes"]),
                                        values(pair[1], s, lambda m: m["nodes"][node]["mem_available_delta_bytes"]), MIB, " MiB"))
            rows.append(row)
    header = ["step", "node"]
    for arm in run.arms:
        header += [f"{arm}: Δ after (MiB)", f"{arm}: lowest during (MiB)"]
    if pair:
        header.append(f"{pair[0]} − {pair[1]}")
    sections.append("## 2. Host MemAvailable per request\n\nChange of MemAvailable from just before the request "
                    "to just after it, and the lowest point during it (1 s samples), relative to before.\n\n"
                    + (_table(header, rows) if rows else "_No nodes configured._"))

    # (3) TTFT
    rows = []
    for s in run.steps:
        row = [s, _prompt_tokens(run, metrics, s)]
        for arm in run.arms:
            row += [_fmt(values(arm, s, lambda m: m["ttft_client_s"]), digits=3),
                    _fmt(values(arm, s, lambda m: m["ttft_server_s"]), digits=3),
                    _fmt(values(arm, s, lambda m: m["e2e_s"]), digits=2), _needle(values(arm, s, lambda m: m["needle_found"]),
                                                                              run, arm, s)]
        if pair:
            row.append(_spread_note(values(pair[0], s, lambda m: m["ttft_client_s"]),
                                    values(pair[1], s, lambda m: m["ttft_client_s"]), 1.0, " s", 3))
        rows.append(row)
    header = ["step", "prompt tokens (usage)"]
    for arm in run.arms:
        header += [f"{arm}: TTFT client (s)", f"{arm}: TTFT server (s)", f"{arm}: e2e (s)", f"{arm}: needle"]
    if pair:
        header.append(f"{pair[0]} − {pair[1]} TTFT")
    sections.append("## 3. Time to first token per request\n\nClient: request sent to first streamed content; "
                    "server: vllm:time_to_first_token_seconds (sum/count deltas around the request).\n\n"
                    + _table(header, rows) + "\n\n" + _cold_statement(metrics))

    # (4) swap and kernel errors
    rows = []
    for s in run.steps:
        for node in run.nodes:
            row = [s, node]
            for arm in run.arms:
                row += [_fmt(values(arm, s, lambda m: m["nodes"][node]["pswpin"]), digits=0) + " / "
                        + _fmt(values(arm, s, lambda m: m["nodes"][node]["pswpout"]), digits=0),
                        _fmt(values(arm, s, lambda m: m["nodes"][node]["max_swap_used_bytes"]), MIB),
                        _fmt(values(arm, s, lambda m: m["nodes"][node]["nv_err_no_memory"]), digits=0),
                        _fmt(values(arm, s, lambda m: m["nodes"][node]["xid"]), digits=0)]
            rows.append(row)
    header = ["step", "node"]
    for arm in run.arms:
        header += [f"{arm}: swap in / out (pages)", f"{arm}: max swap used (MiB)", f"{arm}: NV_ERR_NO_MEMORY", f"{arm}: Xid"]
    sections.append("## 4. Swap and driver errors per request\n\n" + (_table(header, rows) if rows else "_No nodes configured._"))

    sections.append(_failures(run, metrics))
    plots = _plots(run, run_dir, metrics, hook)
    sections.append("## Plots\n\n" + "\n".join(f"![{p.stem}](plots/{p.name})" for p in plots))

    report = run_dir / "report.md"
    report.write_text("\n\n".join(sections) + "\n")
    summary = {
        "arms": run.arms, "steps": run.steps, "repeats": run.repeats, "nodes": run.nodes, "ranks": run.ranks,
        "status": run.run_end, "environment": run.environment,
        "requests": [metrics[k] for k in sorted(metrics, key=lambda k: (k[1], run.arms.index(k[0]), run.steps.index(k[2])))
                     if k[0] in run.arms and k[2] in run.steps],
        "skipped": [{"arm": a, "repeat": r, "step": s, "reason": why} for (a, r, s), why in run.skipped.items()],
        "arm_stops": [{"arm": r["arm"], "repeat": r["repeat"], "reason": r["reason"]} for r in run.stops],
        "hook_growth": [dict(zip(["rank", "arm", "repeat", "step", "calls", "reserved_growth_mib", "first_call_mib",
                                  "last_call_mib", "device_allocs"], row)) for row in location_rows],
        "plots": [f"plots/{p.name}" for p in plots],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return report


def _header(run: _Run, run_dir: Path) -> str:
    env = run.environment
    lines = [f"# A/B report: {', '.join(run.arms)}", "",
             f"Run directory `{run_dir}`; status **{run.run_end or 'unfinished'}**; "
             f"{len(run.steps)} steps × {run.repeats} repeat(s); order {run.ladder.get('order')}; "
             f"memtel {env.get('memtel_version')} ({env.get('git_revision')}) on {env.get('hostname')}.", ""]
    for arm in run.ladder["arms"]:
        info = run.servers.get(arm["name"], {})
        version = info.get("version", {})
        version = version.get("version") if isinstance(version, dict) else version
        how = " ".join(arm["serve"]["command"]) if arm.get("serve") else f"external server {arm['url']}"
        env_text = " ".join(f"{k}={v}" for k, v in ((arm.get("serve") or {}).get("env") or {}).items())
        lines.append(f"- **{arm['name']}**: {env_text + ' ' if env_text else ''}`{how}` (server version {version})")
    return "\n".join(lines)


def _prompt_tokens(run: _Run, metrics: dict, step: str) -> str:
    usage = {m["prompt_tokens_usage"] for k, m in metrics.items() if k[2] == step and m["prompt_tokens_usage"] is not None}
    expected = {m["prompt_tokens_expected"] for k, m in metrics.items() if k[2] == step}
    if not usage:
        return "n/a"
    mark = "exact" if usage <= expected else f"MISMATCH (built {sorted(expected)})"
    return f"{', '.join(f'{u:,}' for u in sorted(usage))} ({mark})"


def _cold_statement(metrics: dict) -> str:
    """Whether every prefill was cold, from the server's prefix-cache hit counter."""
    hits = {k: m["prefix_cache_hit_tokens"] for k, m in metrics.items() if m["ok"]}
    known = {k: v for k, v in hits.items() if v is not None}
    if not known:
        return "Prefix cache: the servers do not export vllm:prefix_cache_hits; coldness not checked."
    warm = [f"{a} r{r} {s} ({v:,.0f} tokens)" for (a, r, s), v in sorted(known.items()) if v > 0]
    if not warm:
        return f"Prefix cache: 0 hit tokens in all {len(known)} requests: every prefill was cold."
    return "Prefix cache HITS (these prefills were not cold): " + ", ".join(warm) + "."


def _needle(found: list, run: _Run, arm: str, step: str) -> str:
    found = [f for f in found if f is not None]
    if not found:
        return "n/a"
    return f"{sum(found)}/{len(found)}"


def _failures(run: _Run, metrics: dict) -> str:
    lines = ["## Failed and skipped requests", ""]
    for key, m in sorted(metrics.items(), key=lambda kv: kv[1]["started_at"]):
        if not m["ok"]:
            lines.append(f"- {key[0]} r{key[1]} {key[2]}: failed: {m['error']}")
    for (arm, r, s), why in run.skipped.items():
        lines.append(f"- {arm} r{r} {s}: skipped: {why}")
    missing = [(a, r, s) for r in range(run.repeats) for a in run.arms for s in run.steps
               if (a, r, s) not in run.requests and (a, r, s) not in run.skipped]
    for a, r, s in missing:
        lines.append(f"- {a} r{r} {s}: not run yet (resume with `memtel ab run LADDER --out DIR --resume`)")
    if len(lines) == 2:
        lines.append("None: every request of every arm completed.")
    return "\n".join(lines)


def _plots(run: _Run, run_dir: Path, metrics: dict, hook: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    paths: list[Path] = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for node in run.nodes:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for i, arm in enumerate(run.arms):
            color = colors[i % len(colors)]
            for r in range(run.repeats):
                points = [(s["ts"], s["mem_available_bytes"]) for s in run.samples[(arm, r, node)]
                          if s.get("mem_available_bytes") is not None]
                points += [(sc["ts"], sc["nodes"][node]["mem_available_bytes"]) for sc in run.scrapes[(arm, r)]
                           if (sc.get("nodes") or {}).get(node, {}).get("mem_available_bytes") is not None]
                if not points:
                    continue
                points.sort()
                t0 = points[0][0]
                # A resumed block had a fresh serve: break the line where each serve's baseline starts.
                breaks = [sc["ts"] for sc in run.scrapes[(arm, r)] if sc["phase"] == "baseline"][1:]
                xs, ys = [], []
                for ts, value in points:
                    while breaks and ts >= breaks[0]:
                        xs.append(breaks.pop(0) - t0)
                        ys.append(float("nan"))
                    xs.append(ts - t0)
                    ys.append(value / 2**30)
                ax.plot(xs, ys, color=color,
                        alpha=1.0 if r == 0 else 0.5, label=f"{arm} r{r}")
                for s in run.steps:
                    m = metrics.get((arm, r, s))
                    if m is not None:
                        ax.axvline(m["started_at"] - t0, color=color, linestyle=":", linewidth=0.8)
                        ax.axvline(m["ended_at"] - t0, color=color, linestyle="--", linewidth=0.8)
        ax.set_title(f"MemAvailable on {node} (dotted: request start, dashed: request end)")
        ax.set_xlabel("seconds since the arm's first scrape")
        ax.set_ylabel("MemAvailable (GiB)")
        if ax.lines:
            ax.legend(loc="best", fontsize=8)
        paths.append(_save(fig, out / f"mem_available_{_safe(node)}.png"))
        plt.close(fig)
    rank_ids = sorted({rank for calls in hook.values() for rank in calls})
    for rank_id in rank_ids:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        drawn = False
        for i, arm in enumerate(run.arms):
            for r in range(run.repeats):
                calls = [c for c in hook[(arm, r)].get(rank_id, []) if "reserved_bytes" in c]
                if calls:
                    ax.plot(range(len(calls)), [c["reserved_bytes"] / 2**30 for c in calls], color=colors[i % len(colors)],
                            alpha=1.0 if r == 0 else 0.5, label=f"{arm} r{r}")
                    drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no allocator data: the hooked process has no CUDA allocator", ha="center",
                    va="center", transform=ax.transAxes)
        ax.set_title(f"Reserved bytes per hooked call, rank {rank_id}")
        ax.set_xlabel("hooked call")
        ax.set_ylabel("reserved (GiB)")
        if drawn:
            ax.legend(loc="best", fontsize=8)
        paths.append(_save(fig, out / f"reserved_rank{rank_id}.png"))
        plt.close(fig)
    if not rank_ids:  # no per-call logs: reserved after each request, from the exporter
        for rank in run.ranks:
            fig, ax = plt.subplots(figsize=(9, 4.5))
            drawn = False
            for i, arm in enumerate(run.arms):
                for r in range(run.repeats):
                    ys = [(metrics.get((arm, r, s)) or {}).get("ranks", {}).get(rank, {}).get("reserved_after_bytes")
                          for s in run.steps]
                    if any(y is not None for y in ys):
                        ax.plot(run.steps, [y / 2**30 if y is not None else float("nan") for y in ys], marker="o",
                                color=colors[i % len(colors)], label=f"{arm} r{r}")
                        drawn = True
            if not drawn:
                ax.text(0.5, 0.5, "no allocator data for this rank", ha="center", va="center", transform=ax.transAxes)
            else:
                ax.legend(loc="best", fontsize=8)
            ax.set_title(f"Reserved bytes after each request, {rank}")
            ax.set_ylabel("reserved (GiB)")
            paths.append(_save(fig, out / f"reserved_{_safe(rank)}.png"))
            plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, 2 * len(run.arms))
    for i, arm in enumerate(run.arms):
        for j, (key, label) in enumerate((("ttft_client_s", "client"), ("ttft_server_s", "server"))):
            ys = [_stats([m[key] for k, m in metrics.items() if k[0] == arm and k[2] == s and m["ok"]]) for s in run.steps]
            xs = [x + (2 * i + j) * width for x in range(len(run.steps))]
            ax.bar(xs, [y[0] if y else 0 for y in ys], width, label=f"{arm} {label}",
                   color=colors[i % len(colors)], alpha=1.0 if j == 0 else 0.55)
    ax.set_xticks([x + width * (len(run.arms) - 0.5) for x in range(len(run.steps))], run.steps)
    ax.set_ylabel("TTFT (s), median over repeats")
    ax.set_title("Time to first token per step")
    ax.legend(loc="best", fontsize=8)
    paths.append(_save(fig, out / "ttft.png"))
    plt.close(fig)
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
