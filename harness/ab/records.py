"""results.jsonl: one typed record per event, appended and fsynced as it happens, read back as the same types.

Every record is a dataclass below; `RecordWriter.write(record)` stamps its `ts` (unix seconds) and writes
``{"event": <its EVENT>, "ts": ..., <its fields>}`` on one line; `read_records` returns the same classes.
The events, in the order a run writes them: `run_start` (the ladder, the environment), `prompt`,
`block_superseded` (a resumed block: its earlier records no longer count), `serve_start` / `serve_ready` /
`serve_failed` / `serve_stop`, `server_info`, `scrape` (phase `baseline` or `after`), `node_sample` (during a
request), `request`, `step_skipped`, `arm_stopped`, `run_end`. Field meanings: docs/harness.md ("Records").

Reading is tolerant where a run's history can be: a line cut by a kill (a harness killed mid-write
leaves one, and `--resume` appends after it) is skipped, and so is an event this version does not know
(a newer writer's); records written before the names were settled (`prompt_token_count`,
`device_alloc_total`, ...) are read under today's names. A known event that lacks a field it needs is
a `RecordError` naming the file, the line and the field: one clear line, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from harness.ab.config import Ladder, LadderError
from telemetry.errors import ConfigError

RESULTS_FILE = "results.jsonl"

R = TypeVar("R", bound="Record")
S = TypeVar("S", bound="Snapshot")


class RecordError(ConfigError):
    """A results.jsonl record that cannot be read; the message names the file, the line and the field."""


# --- scrape snapshots: what one /metrics said ------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Values of one scrape; a series the endpoint does not export is None (never 0). `error`: the scrape failed."""

    LEGACY: ClassVar[dict[str, str]] = {}  # old field name -> today's, for records of earlier versions

    ts: float | None = None
    error: str | None = None

    @classmethod
    def from_json(cls: type[S], data: Mapping[str, Any]) -> S:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in _renamed(data, cls.LEGACY).items() if k in names})


@dataclass(frozen=True, kw_only=True)
class NodeSnapshot(Snapshot):
    """The node daemon's /metrics (memtel_node_*, memtel_kernel_*)."""

    mem_available_bytes: float | None = None
    mem_total_bytes: float | None = None
    swap_used_bytes: float | None = None
    unified_headroom_bytes: float | None = None  # memtel_node_unified_headroom_bytes
    pswpin_total: float | None = None
    pswpout_total: float | None = None
    nv_err_no_memory_total: float | None = None
    xid_total: float | None = None
    xid_by_code: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RankSnapshot(Snapshot):
    """The hook exporter's /metrics of one rank; the allocator fields are named as `AllocatorCounters`'."""

    reserved_bytes: float | None = None
    allocated_bytes: float | None = None
    num_device_alloc: float | None = None
    num_device_free: float | None = None
    num_alloc_retries: float | None = None
    num_ooms: float | None = None
    host_mem_available_bytes: float | None = None
    hook_calls_total: float | None = None
    growth_events_total: float | None = None
    hook_errors_total: float | None = None

    LEGACY: ClassVar[dict[str, str]] = {"device_alloc_total": "num_device_alloc",
                                        "device_free_total": "num_device_free",
                                        "alloc_retries_total": "num_alloc_retries", "ooms_total": "num_ooms"}


@dataclass(frozen=True, kw_only=True)
class ServerSnapshot(Snapshot):
    """The serving engine's /metrics (vLLM's names)."""

    ttft_sum_s: float | None = None
    ttft_count: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None


# --- the records --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Record:
    """One line of results.jsonl. Subclasses set `EVENT`; `ts` is stamped by the writer."""

    EVENT: ClassVar[str] = ""
    LEGACY: ClassVar[dict[str, str]] = {}  # old field name -> today's, for records of earlier versions
    READERS: ClassVar[dict[str, Callable[[Any], Any]]] = {}  # field -> converter from its JSON value

    ts: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"event": self.EVENT, **{f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}}

    @classmethod
    def from_json(cls: type[R], data: Mapping[str, Any]) -> R:
        """The record of a decoded line; KeyError naming the first missing field."""
        data = _renamed(data, cls.LEGACY)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in data:
                read = cls.READERS.get(f.name)
                values[f.name] = _checked(f, data[f.name]) if read is None else read(data[f.name])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise KeyError(f.name)
        return cls(**values)


_SIMPLE_TYPES: dict[str, tuple[type, ...]] = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,),
                                              "dict": (dict,), "list": (list,)}


def _checked(f: dataclasses.Field[Any], value: Any) -> Any:
    """`value` if it has the field's JSON type (bool, int, float, str, dict, list, or None where allowed)."""
    kinds = [part.strip().split("[")[0] for part in str(f.type).split("|")]
    if value is None and "None" in kinds:
        return value
    allowed = tuple(t for kind in kinds if kind != "None" for t in _SIMPLE_TYPES.get(kind, (object,)))
    if not allowed or not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ValueError(f"{f.name!r} is {value!r}, expected {f.type}")
    return value


def _renamed(data: Mapping[str, Any], legacy: Mapping[str, str]) -> Mapping[str, Any]:
    if not legacy or not any(old in data for old in legacy):
        return data
    out = {k: v for k, v in data.items() if k not in legacy}
    for old, new in legacy.items():
        if old in data:
            out[new] = data[old]
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, Ladder):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _snapshots(kind: type[Snapshot]) -> Callable[[Any], dict[str, Any]]:
    return lambda data: {name: kind.from_json(snap) for name, snap in (data or {}).items()}


def _ladder(data: Any) -> Ladder:
    try:
        return Ladder.from_dict(data, source="the recorded ladder")
    except LadderError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True, kw_only=True)
class RunStart(Record):
    EVENT: ClassVar[str] = "run_start"
    READERS: ClassVar[dict[str, Callable[[Any], Any]]] = {"ladder": _ladder}

    resumed: bool
    ladder: Ladder
    ladder_source: str
    ladder_text: str | None = None
    environment: dict[str, Any] = field(default_factory=dict)  # memtel version, git revision, host, python...


@dataclass(frozen=True, kw_only=True)
class PromptBuilt(Record):
    """A step's prompt for one repeat, built once and shared by every arm."""

    EVENT: ClassVar[str] = "prompt"
    LEGACY: ClassVar[dict[str, str]] = {"token_count": "prompt_tokens", "tokens": "target_tokens"}

    step: str
    repeat: int
    seed: int
    target_tokens: int  # what the step asks for
    prompt_tokens: int  # the prompt's length, counted by the server's tokenizer
    tokenize_calls: int
    build_s: float
    sha256: str
    path: str
    needle: str
    answer: str
    question: str
    filler_words: int
    pad_words: int
    built_with: str
    max_model_len: int | None = None
    tokenize_s: float | None = None  # of build_s, the time spent waiting for /tokenize


@dataclass(frozen=True, kw_only=True)
class BlockSuperseded(Record):
    """A block (arm, repeat) is run again from its first step (`--resume` of an unfinished block): the
    block's records written before this one stay in the file but no longer count."""

    EVENT: ClassVar[str] = "block_superseded"

    arm: str
    repeat: int
    steps: list[str]  # the steps that had a request or step_skipped record in the superseded attempt
    reason: str


@dataclass(frozen=True, kw_only=True)
class ServeStart(Record):
    EVENT: ClassVar[str] = "serve_start"

    arm: str
    repeat: int
    command: list[str]
    env: dict[str, str]
    cwd: str | None
    pid: int
    pgid: int
    log: str
    hook_log_dir: str | None = None
    # Who the server is, for `--resume` to stop it if a killed run left it behind (and never a process that
    # reused its pid): the start time in /proc/<pid>/stat (clock ticks since boot) and the boot's id.
    start_time_ticks: int | None = None
    boot_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class ServeReady(Record):
    EVENT: ClassVar[str] = "serve_ready"

    arm: str
    repeat: int
    pgid: int
    startup_s: float


@dataclass(frozen=True, kw_only=True)
class ServeFailed(Record):
    EVENT: ClassVar[str] = "serve_failed"

    arm: str
    repeat: int
    error: str


@dataclass(frozen=True, kw_only=True)
class ServeStop(Record):
    EVENT: ClassVar[str] = "serve_stop"

    pgid: int | None
    how: str  # sigterm, sigkill, already-exited
    exit_code: int | None = None


@dataclass(frozen=True, kw_only=True)
class ServerInfo(Record):
    EVENT: ClassVar[str] = "server_info"

    arm: str
    repeat: int
    url: str
    version: Any = None  # the server's /version (a JSON object), or why it is missing
    models: Any = None  # /v1/models
    rank_errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Scrape(Record):
    """Every node, rank and the server, scraped before the first request (`baseline`) or after one (`after`)."""

    EVENT: ClassVar[str] = "scrape"
    READERS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "nodes": _snapshots(NodeSnapshot), "ranks": _snapshots(RankSnapshot),
        "server": lambda data: None if data is None else ServerSnapshot.from_json(data)}

    phase: str  # baseline | after
    arm: str
    repeat: int
    step: str | None  # the request's step (after), None (baseline)
    nodes: dict[str, NodeSnapshot] = field(default_factory=dict)
    ranks: dict[str, RankSnapshot] = field(default_factory=dict)
    server: ServerSnapshot | None = None
    resumed: bool | None = None  # baseline of a block resumed mid-ladder


@dataclass(frozen=True, kw_only=True)
class NodeSample(Record):
    """One node scraped during a request (every `sample_interval_s`); the snapshot's fields are on the line."""

    EVENT: ClassVar[str] = "node_sample"

    arm: str
    repeat: int
    step: str
    node: str
    snapshot: NodeSnapshot

    def to_json(self) -> dict[str, Any]:
        head = {"event": self.EVENT, "ts": self.ts, "arm": self.arm, "repeat": self.repeat, "step": self.step,
                "node": self.node}
        return {**head, **{k: v for k, v in _plain(self.snapshot).items() if k not in ("ts",)}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeSample:
        return cls(ts=data.get("ts", 0.0), arm=data["arm"], repeat=data["repeat"], step=data["step"],
                   node=data["node"], snapshot=NodeSnapshot.from_json({**data, "ts": data.get("ts")}))


@dataclass(frozen=True, kw_only=True)
class RequestDone(Record):
    """One request of a step: what the client measured, and what the nodes did during it."""

    EVENT: ClassVar[str] = "request"

    arm: str
    repeat: int
    step: str
    seed: int
    target_tokens: int  # what the step asks for
    prompt_tokens: int  # the prompt's length, as built (the server's tokenizer)
    prompt_sha256: str
    usage_prompt_tokens: int | None = None  # what the server's usage block reported
    prompt_tokens_match: bool | None = None  # usage_prompt_tokens == prompt_tokens (None: no usage)
    ok: bool
    error: str | None = None
    status_code: int | None = None
    started_at: float  # unix seconds
    ended_at: float
    ttft_s: float | None = None  # client side: request sent -> first content
    e2e_s: float | None = None
    server_ttft_s: float | None = None  # vllm:time_to_first_token_seconds sum/count deltas around the request
    output_tokens: int | None = None
    content_chunks: int = 0
    finish_reason: str | None = None
    prefix_cache_hit_tokens: float | None = None
    needle_found: bool | None = None  # None: not checked
    answer: str | None = None
    reply: str = ""  # the first 500 characters
    min_mem_available_bytes: dict[str, float] = field(default_factory=dict)  # per node, during the request
    max_swap_used_bytes: dict[str, float] = field(default_factory=dict)
    node_samples: int = 0

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestDone:
        if "prompt_token_count" in data:  # written before the names were settled
            data = {k: v for k, v in data.items() if k not in ("prompt_token_count", "prompt_tokens", "tokens")} | {
                "prompt_tokens": data["prompt_token_count"], "usage_prompt_tokens": data.get("prompt_tokens"),
                "target_tokens": data.get("tokens")}
        return super().from_json(data)


@dataclass(frozen=True, kw_only=True)
class StepSkipped(Record):
    EVENT: ClassVar[str] = "step_skipped"

    arm: str
    repeat: int
    step: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ArmStopped(Record):
    EVENT: ClassVar[str] = "arm_stopped"

    arm: str
    repeat: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class RunEnd(Record):
    EVENT: ClassVar[str] = "run_end"

    status: str  # complete, interrupted, error
    cpu_s: float | None = None  # the harness process's CPU time (user + system) so far, children excluded
    max_rss_bytes: int | None = None  # its peak resident memory so far


RECORD_TYPES: dict[str, type[Record]] = {cls.EVENT: cls for cls in (
    RunStart, PromptBuilt, BlockSuperseded, ServeStart, ServeReady, ServeFailed, ServeStop, ServerInfo, Scrape,
    NodeSample, RequestDone, StepSkipped, ArmStopped, RunEnd)}


# --- writing and reading --------------------------------------------------------------------------


class RecordWriter:
    """Appends records to a results.jsonl created 0600 (never through a symbolic link).

    redact: applied to each record's JSON form before it is written (harness/ab/redact.py: secrets never
    reach the file).
    """

    def __init__(self, path: Path, redact: Callable[[Any], Any] | None = None) -> None:
        from telemetry.safefs import open_private

        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.redact = redact
        try:
            fd = open_private(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            raise RecordError(f"cannot open {self.path} for writing: {exc.strerror or exc} (a symbolic link in its "
                              "place is refused)") from None
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._repair_tail()
        self._lock = threading.Lock()  # the node sampler thread writes too

    def _repair_tail(self) -> None:
        """A line cut by a kill would glue onto the next record: end it first."""
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")

    def write(self, record: R) -> R:
        """Append `record` stamped with the time now; returns the stamped record."""
        stamped = dataclasses.replace(record, ts=time.time())
        data = stamped.to_json()
        if self.redact is not None:
            data = self.redact(data)
        line = json.dumps(data, default=str, allow_nan=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
        return stamped

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


def iter_records(path: Path, *, skip_unreadable: bool = False) -> Iterator[Record]:
    """The records of a results.jsonl in file order (see the module's docstring for what is skipped).

    skip_unreadable: skip a record that cannot be read instead of raising RecordError (best-effort
    readers: finding servers a killed run left behind before the run directory is overwritten).
    """
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line:
                continue
            try:
                data = json.loads(line, parse_constant=_refuse_non_finite)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            except (ValueError, RecursionError) as exc:  # an integer of 4,300+ digits, nesting past the stack
                if skip_unreadable:
                    continue
                raise RecordError(f"{path}:{number}: not a record memtel wrote ({type(exc).__name__}: "
                                  f"{str(exc)[:100]})") from None
            if not isinstance(data, dict):
                continue
            kind = RECORD_TYPES.get(str(data.get("event")))
            if kind is None:
                continue  # a newer writer's event
            try:
                record = kind.from_json(data)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                if skip_unreadable:
                    continue
                raise _record_error(path, number, kind, exc) from None
            yield record


def _refuse_non_finite(name: str) -> float:
    """RecordWriter writes finite numbers only (allow_nan=False): NaN or Infinity is not its line."""
    raise ValueError(f"{name} is not a number memtel writes")


def _record_error(path: Path, number: int, kind: type[Record], exc: Exception) -> RecordError:
    if isinstance(exc, KeyError):
        return RecordError(f"{path}:{number}: the {kind.EVENT} record has no {exc.args[0]!r} field "
                           "(written by another memtel version, or edited?)")
    return RecordError(f"{path}:{number}: the {kind.EVENT} record cannot be read: {exc}")


def read_records(path: Path, *, skip_unreadable: bool = False) -> list[Record]:
    return list(iter_records(path, skip_unreadable=skip_unreadable))


def of_type(records: Iterable[Record], kind: type[R]) -> list[R]:
    return [r for r in records if isinstance(r, kind)]


StepKey = tuple[str, int, str]  # (arm, repeat, step label)


def block_of(record: Record) -> tuple[str, int] | None:
    """The (arm, repeat) block a record belongs to, None for run-wide records (run_start, prompt, run_end).

    A serve_stop names only its process group: it belongs to the block of the serve_start with that group.
    """
    arm, repeat = getattr(record, "arm", None), getattr(record, "repeat", None)
    if isinstance(arm, str) and isinstance(repeat, int) and not isinstance(record, PromptBuilt):
        return (arm, repeat)
    return None


def current_records(records: Iterable[Record]) -> list[Record]:
    """The records that count: a block's records written before its last `block_superseded` are left out
    (with the serve_stop of a server started in the superseded attempt)."""
    records = list(records)
    last_superseded = {(r.arm, r.repeat): i for i, r in enumerate(records) if isinstance(r, BlockSuperseded)}
    if not last_superseded:
        return records
    stale_groups: set[int] = set()
    out = []
    for i, r in enumerate(records):
        block = block_of(r)
        if block is not None and i < last_superseded.get(block, -1):
            if isinstance(r, ServeStart):
                stale_groups.add(r.pgid)
            continue
        if isinstance(r, ServeStop) and r.pgid in stale_groups:
            stale_groups.discard(r.pgid)
            continue
        out.append(r)
    return out


def finished_steps(records: Iterable[Record]) -> set[StepKey]:
    """Steps with a request (ok or failed) or a step_skipped record among the records that count."""
    return {(r.arm, r.repeat, r.step) for r in current_records(records) if isinstance(r, (RequestDone, StepSkipped))}


def unstopped_servers(records: Iterable[Record]) -> list[ServeStart]:
    """serve_start records without a serve_stop: servers a killed harness may have left running."""
    started: dict[int, ServeStart] = {}
    for r in records:
        if isinstance(r, ServeStart):
            started[r.pgid] = r
        elif isinstance(r, ServeStop) and r.pgid is not None:
            started.pop(r.pgid, None)
    return list(started.values())


__all__ = ["RECORD_TYPES", "RESULTS_FILE", "ArmStopped", "BlockSuperseded", "NodeSample", "NodeSnapshot", "PromptBuilt",
           "RankSnapshot", "Record", "RecordError", "RecordWriter", "RequestDone", "RunEnd", "RunStart", "Scrape",
           "ServeFailed", "ServeReady", "ServeStart", "ServeStop", "ServerInfo", "ServerSnapshot", "Snapshot",
           "StepKey", "StepSkipped", "block_of", "current_records", "finished_steps", "iter_records", "of_type",
           "read_records", "unstopped_servers"]
