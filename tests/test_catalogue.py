"""One catalogue of names (telemetry/catalogue): what memtel produces, and what its docs, rules, dashboards and
golden files name, must agree with it.

`test_every_metric_name_agrees_with_the_catalogue` gathers every problem and fails once, listing them all:
- a family a collector produces (run live on fixtures: the daemon's collectors, its health, the flight
  recorder, the exporter's HTTP health, the hook's exporter over HTTP, the live forecast) that the catalogue
  lacks, or whose type, help or labels differ from its entry (with a catalogue line to paste);
- a metric name typed in code outside the catalogue: any `memtel_...` or `vllm:...` in a string of telemetry/,
  harness/ or benchmarks/ (docstrings aside), whether it builds a family, reads one back (the readers look series
  up by entry: telemetry/scrape) or names one in a message; only `_NOT_METRICS` and `fields.OTHER_NAMES`, which
  are no metric, each with its reason, may be typed;
- a memtel series named in docs/*.md, dashboards/README.md, a Prometheus rule or rule test
  (dashboards/prometheus/), a Grafana dashboard or a golden file (tests/fixtures/) that nothing produces
  (recording-rule outputs count as produced);
- a catalogue family that no doc lists.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from telemetry.catalogue import FAMILIES, Family, fields, sample_names
from telemetry.catalogue.vllm import VLLM_FAMILIES
from tests.hook.test_golden_metrics import golden_exporter  # noqa: F401  (a fixture: the hook's real exporter)

if TYPE_CHECKING:
    from telemetry.flight.recorder import FlightRecorder

ROOT = Path(__file__).parents[1]
VLLM_SERIES = {name for entry in VLLM_FAMILIES.values() for name in entry.sample_names}
FIXTURES = ROOT / "tests" / "fixtures"
PROC = FIXTURES / "proc"

# A memtel series as written in text: `memtel_x`, `level:memtel_x:op`, `memtel:x` (a recording rule's output).
_TOKEN = re.compile(r"(?<![A-Za-z0-9_:./\-])((?:[a-z_]+:)?memtel[_:][A-Za-z0-9_:]*)(\*?)")
# A metric name (or a prefix of names) inside a string of code.
_NAME_IN_CODE = re.compile(r"(?<![A-Za-z0-9_:.\-/])(memtel_[A-Za-z0-9_]*|vllm:[A-Za-z0-9_:]+)")
# memtel identifiers typed in code that are no metric (besides fields.OTHER_NAMES), with why.
_NOT_METRICS = {
    "memtel_score_sentinel": "the synthetic series of `memtel alerts score`'s promtool test, never exported",
    "memtel_score_query": "the label that names the score's queries in that test, never exported",
    "memtel_version": "a key of results.jsonl's environment record",
    "memtel_snapshot_native": "the name of the native snapshot reader's build",
    "memtel_bench_target": "the module the hook benchmark hooks",
    "memtel_default": "an arm of benchmarks/daemon_bench.py",
    "memtel_same_sources": "an arm of benchmarks/daemon_bench.py",
    "memtel_deployment": "a key of a LiteLLM request's metadata (telemetry/litellm)",
    "memtel_litellm_receive": "the name of a context variable in telemetry/litellm/client.py",
    "memtel_litellm_endings": "the name of a context variable in telemetry/litellm/client.py",
    "memtel_refusal": "an attribute the LiteLLM gate sets on its own refusals (telemetry/litellm/pre_call.py)",
}


# -- what is produced -------------------------------------------------------------------------------
def _daemon_sources() -> dict[str, Collector]:
    """The daemon's collectors on fixtures, each exporting every family it can."""
    from telemetry.daemon.collectors.buddyinfo import BuddyinfoCollector
    from telemetry.daemon.collectors.headroom import HeadroomCollector
    from telemetry.daemon.collectors.kmsg import kmsg_families
    from telemetry.daemon.collectors.meminfo import MeminfoCollector
    from telemetry.daemon.collectors.nvml import NvmlCollector, NvmlSnapshot
    from telemetry.daemon.collectors.pressure import PressureCollector
    from telemetry.daemon.collectors.processes import ProcessCollector
    from telemetry.daemon.collectors.vmstat import VmstatCollector
    from telemetry.daemon.kmsg.counts import CountsSnapshot
    from telemetry.procfs.headroom import FaultOutcomes

    meminfo, vmstat, buddyinfo = (str(PROC / f"{n}.x86_64-debian12-24g") for n in ("meminfo", "vmstat", "buddyinfo"))
    snapshot = NvmlSnapshot.from_dict(json.loads((FIXTURES / "nvml" / "hgx__h200__580.159.04.json").read_text()))
    kinds = ("nv_err_no_memory", "nvrm_error", "oom_kill", "xid:79", "pattern:uvm")
    counts = CountsSnapshot(lines=dict.fromkeys(kinds, 2), events=dict.fromkeys(kinds, 1),
                            last_seen_wall=dict.fromkeys(kinds, 1.0e9))

    class Kmsg(Collector):
        def collect(self) -> list[Metric]:
            return kmsg_families(counts, ("uvm",))

    # Huge-page faults over the last window, in a THP mode whose fallbacks tried compaction (the fixture's counters
    # are 0, and the mode is this host's to say): the faults' success ratio is exported too.
    window = types.SimpleNamespace(add=lambda _vmstat: FaultOutcomes(90, 10, 300.0))
    headroom = HeadroomCollector(meminfo, buddyinfo, vmstat_path=vmstat, window=window)  # type: ignore[arg-type]
    headroom.reader.faults_are_evidence = True
    return {
        "meminfo": MeminfoCollector(meminfo), "vmstat": VmstatCollector(vmstat),
        "pressure": PressureCollector(str(PROC / "pressure-memory.x86_64-debian12-24g")),
        "buddyinfo": BuddyinfoCollector(buddyinfo),
        "headroom": headroom,
        "nvml": NvmlCollector(types.SimpleNamespace(read=lambda: snapshot)),  # type: ignore[arg-type]
        "processes": ProcessCollector(), "kmsg": Kmsg(),
    }


def _daemon_families(tmp_path: Path) -> list[Metric]:
    from telemetry.daemon.registry import DaemonCollectors

    wrapper = DaemonCollectors(_daemon_sources())
    return [*wrapper.collect(), *_flight_recorder(tmp_path).collect(), *_exporter_families()]


def _flight_recorder(tmp_path: Path) -> FlightRecorder:
    from telemetry.flight.recorder import BootSummary, FlightRecorder

    recorder = FlightRecorder(tmp_path / "flight", "boot")
    # The state after a record was written, with a previous boot's ring read: every family is present.
    recorder.recording, recorder.last_record_time, recorder.last_write_seconds = True, 1.0e9, 0.001
    recorder.last_record_bytes = 900
    recorder.previous = BootSummary("previous", 10, 1.0e9, 1.0e9)
    return recorder


def _exporter_families() -> list[Metric]:
    from telemetry.exporter import MetricsServer
    from telemetry.exporter.metrics import ExporterCollector

    server = MetricsServer("127.0.0.1", 0, CollectorRegistry(auto_describe=False), name="catalogue test")
    try:
        return list(ExporterCollector(server).collect())
    finally:
        server.stop()


def _forecast_families() -> list[Metric]:
    from telemetry.allocator_counters import AllocatorCounters
    from telemetry.hook.forecast.collector import ForecastCollector
    from telemetry.hook.forecast.runner import ForecastResults
    from telemetry.hook.forecast.workload import make_workload
    from telemetry.hook.state import HookState
    from telemetry.model.indexer.forecast import Forecast
    from telemetry.model.indexer.shape import REFERENCE_SHAPE

    forecast = Forecast(tokens=1000, mode="stock", alloc_conf="", start=AllocatorCounters(0, 0, 0, 0),
                        reserved_growth_bytes=1, peak_reserved_bytes=2, peak_growth_bytes=2, num_device_alloc=1,
                        num_device_free=0)
    results = ForecastResults(workload=make_workload(REFERENCE_SHAPE, source="reference"), forecasts=(forecast,),
                              last_duration_s=0.1,
                              last_success_s=1.0e9, failures={"snapshot": 1}, cpu_seconds=0.5)
    state = HookState(node="n", targets={})
    return list(ForecastCollector(types.SimpleNamespace(results=results), state).collect())  # type: ignore[arg-type]


def _label_names(family: Metric) -> set[str]:
    if family.samples:
        return {key for sample in family.samples for key in sample.labels if key != "le"}
    return set(getattr(family, "_labelnames", ()))


def _paste_line(family: Metric, labels: set[str]) -> str:
    kind = {"gauge": "gauge", "counter": "counter", "histogram": "histogram"}.get(family.type, family.type)
    return f'{kind}("{family.name}", {family.documentation!r}, {tuple(sorted(labels))!r}, source="...")'


def _check_produced(families: list[Metric], where: str, problems: list[str]) -> set[str]:
    seen = set()
    for family in families:
        seen.add(family.name)
        entry = FAMILIES.get(family.name)
        labels = _label_names(family)
        if entry is None:
            problems.append(f"{where} produces {family.name}, which the catalogue lacks; add to "
                            f"telemetry/catalogue/metrics.py: {_paste_line(family, labels)}")
            continue
        if family.type != entry.type:
            problems.append(f"{family.name}: {where} produces a {family.type}, the catalogue says {entry.type}")
        if family.documentation != entry.help:
            problems.append(f"{family.name}: {where}'s help {family.documentation!r} != the catalogue's {entry.help!r}")
        if labels and labels != set(entry.labels):
            problems.append(f"{family.name}: {where}'s labels {sorted(labels)} != the catalogue's {list(entry.labels)}")
    return seen


def _constants_holding(family: Family) -> list[str]:
    """The names in telemetry/catalogue/metrics.py under which code reaches `family` (itself or a table of it)."""
    import telemetry.catalogue.metrics as metrics_module

    def holds(value: object) -> bool:
        if value is family:
            return True
        return isinstance(value, tuple) and any(holds(item) for item in value)

    return [name for name, value in vars(metrics_module).items() if not name.startswith("_") and holds(value)]


def _strings_naming_series(tree: ast.AST) -> list[ast.Constant]:
    """The strings of `tree` that may name a series: not statements (docstrings and the like: documentation) and
    not the items of `__all__` (Python names). One walk."""
    strings: list[ast.Constant] = []
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            skip.update(id(item) for item in ast.walk(node.value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.append(node)
    return [node for node in strings if id(node) not in skip]


def _typed_in_code(roots: tuple[Path, ...] = (ROOT / "telemetry", ROOT / "harness", ROOT / "benchmarks")
                   ) -> dict[str, list[str]]:
    """memtel and vLLM metric names typed in strings of code outside the catalogue: name -> `file:line`s."""
    typed: dict[str, list[str]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "catalogue" in path.parts:
                continue
            text = path.read_text()
            if "memtel_" not in text and "vllm:" not in text:   # most files name no series at all: not parsed
                continue
            for node in _strings_naming_series(ast.parse(text)):
                for match in _NAME_IN_CODE.finditer(node.value):
                    where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno}"
                    typed.setdefault(match.group(1), []).append(where)
    return typed


def _typed_problems(typed: dict[str, list[str]]) -> list[str]:
    problems = []
    for name, places in sorted(typed.items()):
        if name in _NOT_METRICS or name in fields.OTHER_NAMES:
            continue
        for place in sorted(set(places)):
            if name in FAMILIES or name in VLLM_FAMILIES or name in sample_names() or name in VLLM_SERIES:
                problems.append(f"{place} types {name} (a catalogue entry's name): name it through its entry "
                                "(`ENTRY.series`; telemetry/scrape reads series by entry)")
            else:
                problems.append(f"{place} types {name} (no catalogue entry's name): a metric belongs in the "
                                "catalogue; an identifier that is no metric in tests/test_catalogue.py _NOT_METRICS, "
                                "with why")
    return problems


# -- what is named ----------------------------------------------------------------------------------
def _recording_rule_outputs() -> set[str]:
    outputs = set()
    for path in sorted((ROOT / "dashboards" / "prometheus").glob("*.yml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            outputs.update(rule["record"] for rule in group.get("rules", []) if "record" in rule)
    return outputs


def _named_files() -> list[Path]:
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "dashboards" / "README.md",
             *sorted((ROOT / "dashboards" / "prometheus").rglob("*.yml")),
             *sorted((ROOT / "dashboards" / "grafana").glob("*.json"))]
    files += [p for p in sorted(FIXTURES.rglob("*")) if p.is_file() and p.suffix in (".prom", ".md", ".yml", ".txt")]
    return files


def _names_in(path: Path) -> set[str]:
    text = path.read_text()
    if path.suffix == ".prom":  # a golden scrape: its sample names (label values name hooked test functions)
        return {m.group(1) for line in text.splitlines()
                if (m := re.match(r"(?:# (?:HELP|TYPE) )?([A-Za-z_:][A-Za-z0-9_:]*)", line)) and "memtel" in m.group(1)}
    names = set()
    for match in _TOKEN.finditer(text):
        token, star = match.group(1).rstrip(":"), match.group(2)
        if token == "memtel":  # "memtel: ..." (a log line), not a name
            continue
        names.add(token + star if star or token.endswith("_") else token)
    return names


def _known_names() -> set[str]:
    """Series and family names of the catalogue, recording rules' outputs and the other memtel identifiers."""
    return {*sample_names(), *FAMILIES, *_recording_rule_outputs(), *fields.OTHER_NAMES}


def _known(name: str, produced: set[str]) -> bool:
    if name.endswith("*") or name.endswith("_"):  # a prefix: memtel_hook_*, memtel_forecast_
        prefix = name.rstrip("*")
        return any(p.startswith(prefix) for p in produced)
    return name in produced


def test_every_metric_name_agrees_with_the_catalogue(tmp_path, golden_exporter):  # noqa: F811
    problems: list[str] = []
    produced_names = set()
    produced_names |= _check_produced(_daemon_families(tmp_path), "the node daemon", problems)
    hook_text = httpx.get(golden_exporter, timeout=5).text
    produced_names |= _check_produced(list(text_string_to_metric_families(hook_text)), "the hook's exporter",
                                      problems)
    produced_names |= _check_produced(_forecast_families(), "the live forecast", problems)

    typed = _typed_in_code()
    problems += _typed_problems(typed)
    code = "\n".join(p.read_text() for pkg in ("telemetry", "harness") for p in (ROOT / pkg).rglob("*.py")
                     if "catalogue" not in p.parts)
    identifiers = set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", code))
    for family in FAMILIES.values():
        if family.name in produced_names or family.name in typed:
            continue
        if not any(constant in identifiers for constant in _constants_holding(family)):
            problems.append(f"the catalogue lists {family.name}, which nothing produces")

    known = _known_names()
    for path in _named_files():
        for name in sorted(_names_in(path)):
            if not _known(name, known):
                problems.append(f"{path.relative_to(ROOT)} names {name}, which nothing produces")

    documented = set().union(*(_names_in(p) for p in [*(ROOT / "docs").glob("*.md"), ROOT / "dashboards/README.md"]))
    for family in FAMILIES.values():
        if family.series not in documented:
            problems.append(f"{family.series} ({family.source}) is produced but no doc lists it (docs/*.md)")

    assert not problems, (f"{len(problems)} name problem(s):\n" + "\n".join(problems) + "\n(the catalogue: "
                          "telemetry/catalogue/metrics.py; \"nothing produces\": no catalogue series, no recording "
                          "rule; a memtel identifier that is no metric: telemetry/catalogue/fields.py OTHER_NAMES)")


def test_a_misspelt_name_in_a_doc_is_caught(tmp_path):
    """The check itself: an unknown name, a prefix that matches nothing, and the forms that are allowed."""
    known = _known_names()
    doc = tmp_path / "x.md"
    doc.write_text("`memtel_node_mem_available_byte` and `memtel_nope_*`; `memtel_hook_*`, "
                   "rate(memtel_hook_calls_total[5m]), instance:memtel_node_mem_available:ratio, test_memtel_port\n")
    unknown = sorted(n for n in _names_in(doc) if not _known(n, known))
    assert unknown == ["memtel_node_mem_available_byte", "memtel_nope_*"]


def test_a_name_typed_by_a_reader_is_caught(tmp_path):
    """The check itself: a reader that types a series (plain, in an f-string, as a prefix) is caught wherever it
    is; a docstring, a non-metric identifier and an upper-case environment variable are not."""
    code = tmp_path / "reader.py"
    code.write_text('''"""Reads memtel_node_mem_available_bytes (a docstring: documentation)."""
def read(scrape, rank):
    """memtel_hook_calls_total, again documentation."""
    log = "MEMTEL_PORT and memtel_timeline are no metrics"
    return (scrape.first("memtel_node_mem_available_bytes"), f'vllm:num_requests_running{{rank="{rank}"}}',
            [n for n in scrape if n.startswith("memtel_engine_")])
''')
    problems = _typed_problems(_typed_in_code((tmp_path,)))
    assert [p.split(" (")[0] for p in problems] == [
        f"{code}:6 types memtel_engine_", f"{code}:5 types memtel_node_mem_available_bytes",
        f"{code}:5 types vllm:num_requests_running"], problems


def test_the_lab_exports_its_entries_names_help_and_labels():
    """The lab server's /metrics: vLLM's series (telemetry/catalogue/vllm.py) and memtel_lab_*, each as its entry."""
    from harness.labserver.server import LabMetrics
    from telemetry.catalogue.metrics import LAB_INDEXER_LAUNCHES

    problems: list[str] = []
    families = list(LabMetrics("m").registry.collect())
    vllm_seen = {f.name for f in families if f.name in VLLM_FAMILIES}
    lab = [f for f in families if f.name not in VLLM_FAMILIES]
    for family in families:
        entry = VLLM_FAMILIES.get(family.name) or FAMILIES.get(family.name)
        if entry is None:
            problems.append(f"the lab produces {family.name}, which no entry has")
        elif (family.type, family.documentation, _label_names(family)) != (entry.type, entry.help, set(entry.labels)):
            problems.append(f"{family.name}: the lab's {family.type} {family.documentation!r} "
                            f"{sorted(_label_names(family))} != its entry's")
    assert not problems, problems
    assert vllm_seen == set(VLLM_FAMILIES) and [f.name for f in lab] == [LAB_INDEXER_LAUNCHES.name]


# -- record fields ----------------------------------------------------------------------------------
def test_the_call_log_keys_are_the_catalogues_and_documented():
    from telemetry.hook.call_log import KEYS

    assert KEYS == fields.CALL_LOG_KEYS
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Hook per-call log (JSONL)"):]
    section = section[:section.index("\n## ")]
    missing = [key for key in fields.CALL_LOG_KEYS if f"`{key}`" not in section]
    assert missing == [], f"docs/architecture.md's per-call log section lacks {missing}"


def test_the_hooks_log_writes_the_catalogues_keys_in_order(golden_exporter, tmp_path):  # noqa: F811
    logs = list((tmp_path / "logs").glob("memtel-calls-*.jsonl"))
    lines = [json.loads(line) for path in logs for line in path.read_text().splitlines()]
    assert lines
    for record in lines:
        keys = list(record)
        assert keys == [k for k in fields.CALL_LOG_KEYS if k in record], keys
        assert set(fields.ALLOCATOR_COUNTERS) <= set(keys) or not set(fields.ALLOCATOR_COUNTERS) & set(keys)


def test_the_harness_snapshots_read_the_catalogues_series():
    from harness.ab import samplers
    from harness.ab.records import NodeSnapshot, RankSnapshot

    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"ts", "error", "xid_by_code"}

    assert names(NodeSnapshot) == set(fields.NODE_SNAPSHOT_SERIES)
    assert names(RankSnapshot) == set(fields.RANK_SNAPSHOT_SERIES)
    assert samplers.NODE_SERIES is fields.NODE_SNAPSHOT_SERIES
    produced = set(sample_names())
    assert set(fields.NODE_SNAPSHOT_SERIES.values()) | set(fields.RANK_SNAPSHOT_SERIES.values()) <= produced


_OTHER_SPELLINGS = re.compile(r"""(?<![A-Za-z0-9_])(?:device_allocs|device_alloc_total|device_free_total|"""
                              r"""device_frees|alloc_retries_total|ooms_total)(?![A-Za-z0-9_])""")


def test_allocator_counters_are_spelt_one_way():
    """`num_device_alloc` & co. everywhere: records, tables, reports, docs. The only other spellings allowed are the
    results.jsonl reader's map from the old field names (harness/ab/records.py LEGACY) and Prometheus' names."""
    found = []
    for package in ("telemetry", "harness", "benchmarks", "docs"):
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix not in (".py", ".md") or "catalogue" in path.parts:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if path.relative_to(ROOT).as_posix() == "harness/ab/records.py" or "`device_alloc_total`, ...)" in line:
                    continue  # the results.jsonl reader's old names, and the docs' sentence about them
                for match in _OTHER_SPELLINGS.finditer(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert found == [], f"{len(found)} other spelling(s) of the allocator counters:\n" + "\n".join(found)


@pytest.mark.parametrize("name", ["memtel_hook_calls", "memtel_hook_calls_total"])
def test_family_lookup_by_family_or_series_name(name):
    from telemetry.catalogue import family

    assert family(name).series == "memtel_hook_calls_total"
    with pytest.raises(KeyError):
        family("memtel_hook_call")


# -- describe(): a collector names its families from the catalogue ----------------------------------------
def _collectors(tmp_path: Path) -> dict[str, Collector]:
    """memtel's custom collectors, each in a state where it exports every family it can (fixtures, no server)."""
    from telemetry.daemon.registry import DaemonCollectors
    from telemetry.exporter.metrics import ExporterCollector
    from telemetry.guard.limit import LimitTracker, RankFit
    from telemetry.guard.metrics import GuardCollector, GuardMetrics
    from telemetry.hook.engine import EngineCollector, EngineMemory, EngineTracker, ProcessNow
    from telemetry.hook.state import HookState
    from telemetry.url import parse_url

    trackers = [LimitTracker([parse_url(f"http://127.0.0.1:{port}")], stale_s=60) for port in (1, 2)]
    for tracker in trackers:   # a fresh forecast from each: a limit in force on both replicas
        tracker.record(tracker.hooks[0], [RankFit("0", "n", 1000, 1e9, time.time(), (), 2000)], None)
        tracker.limit()
        tracker.published_at_best = tracker.at_best()   # as the scrape loop does: the at-best limit is known
    replicas = [types.SimpleNamespace(name=f"r{n}", tracker=t, healthy=True) for n, t in enumerate(trackers)]
    server = types.SimpleNamespace(counts=dict, open_connections=1, max_connections=8)

    class Engine(EngineCollector):   # a CUDA process, which this machine has not: what it holds, read
        def now(self) -> ProcessNow:
            return ProcessNow(4 << 30, 3 << 30, 60 << 30, 80 << 30, 1 << 30)

    engine = EngineTracker()
    engine.memory = EngineMemory(weights_bytes=1 << 30, kv_cache_bytes=2 << 30, cuda_graph_pool_bytes=1 << 20)
    engine.starting, engine.start_plan_bytes = True, 50 << 30
    return {
        "daemon": DaemonCollectors({**_daemon_sources(), "flight": _flight_recorder(tmp_path)}),
        "exporter": ExporterCollector(server),  # type: ignore[arg-type]
        "guard": GuardCollector(GuardMetrics(), trackers[0], replicas),  # type: ignore[arg-type]
        "engine": Engine(engine, HookState(node="n", targets={})),
    }


def test_describe_names_exactly_what_collect_yields(tmp_path):
    """describe() (from the catalogue's entries) and collect() cannot drift apart: each collector, exporting all it
    can, names exactly the families it describes."""
    drift = {}
    for name, collector in _collectors(tmp_path).items():
        described, collected = ({f.name for f in collector.describe()}, {f.name for f in collector.collect()})
        if described != collected:
            drift[name] = {"described only": sorted(described - collected),
                           "collected only": sorted(collected - described)}
    assert drift == {}


def test_a_second_collector_of_the_same_families_is_refused(tmp_path):
    """describe() is what a registry checks names with: registering a second collector of one family fails (an
    empty describe() let it through, and /metrics then repeated the family)."""
    first, second = _collectors(tmp_path), _collectors(tmp_path)
    for name in first:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(first[name])
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            registry.register(second[name])
