"""The record fields memtel writes and reads back, and which exported series each snapshot field is read from.

- `ALLOCATOR_COUNTERS`: the caching allocator's counters, spelled as PyTorch spells them
  (`telemetry.allocator_counters.FIELDS`) in every record, table and report; `ALLOCATOR_FAMILIES` is the
  hook's metric family of each.
- `CALL_LOG_KEYS`: the keys of a line of the hook's per-call log (JSONL), in the order they are written.
- `NODE_SNAPSHOT_SERIES`, `RANK_SNAPSHOT_SERIES`: the A/B harness's snapshot fields (results.jsonl `nodes` and
  `ranks`, harness/ab/records.py) and the series the samplers read each from; `RANK_PER_SITE` are summed over
  sites, the others are process-wide (the largest is taken).
"""

from __future__ import annotations

from telemetry.allocator_counters import FIELDS as ALLOCATOR_COUNTERS
from telemetry.catalogue import metrics as m
from telemetry.catalogue.family import CounterFamily, GaugeFamily

ALLOCATOR_FAMILIES: tuple[tuple[str, GaugeFamily | CounterFamily], ...] = tuple(zip(ALLOCATOR_COUNTERS, (
    m.ALLOCATOR_RESERVED, m.ALLOCATOR_ALLOCATED, m.ALLOCATOR_DEVICE_ALLOC, m.ALLOCATOR_DEVICE_FREE,
    m.ALLOCATOR_ALLOC_RETRIES, m.ALLOCATOR_OOMS,
), strict=True))

CALL_LOG_KEYS = ("ts", "call", "site", "rank", "pid", "node", "device", *ALLOCATOR_COUNTERS, "mem_available_bytes",
                 "swap_free_bytes", "shape")

NODE_SNAPSHOT_SERIES: dict[str, str] = {
    "mem_available_bytes": m.MEM_AVAILABLE.series,
    "mem_total_bytes": m.MEM_TOTAL.series,
    "swap_used_bytes": m.SWAP_USED.series,
    "unified_headroom_bytes": m.UNIFIED_HEADROOM.series,
    "pswpin_total": m.VMSTAT_FIELDS[0][0].series,
    "pswpout_total": m.VMSTAT_FIELDS[1][0].series,
    "nv_err_no_memory_total": m.KERNEL_NV_ERR_NO_MEMORY[0].series,
    "xid_total": m.KERNEL_XID[0].series,
}
NODE_XID_LABEL = m.KERNEL_XID[0].labels[0]  # NodeSnapshot.xid_by_code is keyed by it

RANK_PROCESS_WIDE: dict[str, str] = {
    **{field: family.series for field, family in ALLOCATOR_FAMILIES},
    "host_mem_available_bytes": m.HOOK_HOST_MEM_AVAILABLE.series,
}
RANK_PER_SITE: dict[str, str] = {
    "hook_calls_total": m.HOOK_CALLS.series,
    "growth_events_total": m.HOOK_GROWTH_EVENTS.series,
    "hook_errors_total": m.HOOK_ERRORS.series,
}
RANK_SNAPSHOT_SERIES: dict[str, str] = {**RANK_PROCESS_WIDE, **RANK_PER_SITE}

# The `error.type` of the answers `memtel guard` gives itself (telemetry/guard/proxy.py, docs/guard.md).
GUARD_WOULD_NOT_FIT = "memtel_would_not_fit"
GUARD_BLIND = "memtel_guard_blind"  # also the name of its gauge: the answer while that gauge is 1
GUARD_BAD_REQUEST = "memtel_bad_request"
GUARD_NOT_FORWARDED = "memtel_not_forwarded"
GUARD_UPSTREAM_UNAVAILABLE = "memtel_upstream_unavailable"
GUARD_UPSTREAM_ERROR = "memtel_upstream_error"
GUARD_ERROR_TYPES = (GUARD_WOULD_NOT_FIT, GUARD_BLIND, GUARD_BAD_REQUEST, GUARD_NOT_FORWARDED,
                     GUARD_UPSTREAM_UNAVAILABLE, GUARD_UPSTREAM_ERROR)

OTHER_NAMES: frozenset[str] = frozenset({
    "memtel_timeline",  # the outcome line of a timeline file (telemetry/alerts/timeline.py)
    "memtel_hold",  # the LiteLLM gate's key of a hold in a request's metadata (telemetry/litellm/gate.py)
    "memtel_hooks",  # a LiteLLM deployment's key, a Ray replica's routing-stats key: the hooks' URLs
    "memtel_upstream",  # a Ray replica's routing-stats key: the engine it fronts (telemetry/ray)
    *GUARD_ERROR_TYPES,
})
"""memtel identifiers that docs name and that are no metric (error types in answers, ...), so the name check
(tests/test_catalogue.py) knows them."""

__all__ = [
    "ALLOCATOR_COUNTERS",
    "ALLOCATOR_FAMILIES",
    "CALL_LOG_KEYS",
    "GUARD_BAD_REQUEST",
    "GUARD_BLIND",
    "GUARD_ERROR_TYPES",
    "GUARD_NOT_FORWARDED",
    "GUARD_UPSTREAM_ERROR",
    "GUARD_UPSTREAM_UNAVAILABLE",
    "GUARD_WOULD_NOT_FIT",
    "NODE_SNAPSHOT_SERIES",
    "NODE_XID_LABEL",
    "OTHER_NAMES",
    "RANK_PER_SITE",
    "RANK_PROCESS_WIDE",
    "RANK_SNAPSHOT_SERIES",
]
