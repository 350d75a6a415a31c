"""kmsg collector: renders the kernel-log follower's counts. Fails while the log cannot be read."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from telemetry.daemon.kmsg.classify import NV_ERR_NO_MEMORY, NVRM_ERROR, OOM_KILL, PATTERN_PREFIX, XID_PREFIX
from telemetry.daemon.kmsg.counts import CountsSnapshot
from telemetry.daemon.kmsg.follower import KmsgFollower

# kind -> (lines counter, events counter, last-seen gauge, what a line is)
_PLAIN_KINDS = (
    (NV_ERR_NO_MEMORY, "memtel_kernel_nv_err_no_memory", "memtel_kernel_nv_err_no_memory_events",
     "memtel_kernel_nv_err_no_memory_last_seen_timestamp_seconds", "NVIDIA driver lines reporting NV_ERR_NO_MEMORY"),
    (NVRM_ERROR, "memtel_kernel_nvrm_errors", "memtel_kernel_nvrm_error_events",
     "memtel_kernel_nvrm_error_last_seen_timestamp_seconds", "NVRM (NVIDIA driver) error lines"),
    (OOM_KILL, "memtel_kernel_oom_kills", "memtel_kernel_oom_kill_events",
     "memtel_kernel_oom_kill_last_seen_timestamp_seconds", "kernel OOM-killer kill lines"),
)
_LABELED_KINDS = (
    (XID_PREFIX, "xid", "memtel_kernel_xid", "memtel_kernel_xid_events",
     "memtel_kernel_xid_last_seen_timestamp_seconds", "NVRM Xid lines, by Xid code"),
    (PATTERN_PREFIX, "pattern", "memtel_kernel_pattern_matches", "memtel_kernel_pattern_events",
     "memtel_kernel_pattern_last_seen_timestamp_seconds", "kernel log lines matching the user pattern"),
)


def kmsg_families(snap: CountsSnapshot, pattern_names: tuple[str, ...] = ()) -> list[Metric]:
    families: list[Metric] = []
    for kind, lines_name, events_name, seen_name, what in _PLAIN_KINDS:
        # These counters always exist (0 until a line comes), so rate() and increase() work from the start.
        families.append(CounterMetricFamily(lines_name, f"Kernel log: {what}.", value=snap.lines.get(kind, 0)))
        families.append(CounterMetricFamily(
            events_name, f"Kernel log: bursts of {what} (lines within the burst window count once).",
            value=snap.events.get(kind, 0),
        ))
        if kind in snap.last_seen_wall:
            families.append(GaugeMetricFamily(
                seen_name, f"Unix time of the last of the {what}.", value=snap.last_seen_wall[kind]
            ))
    for prefix, label, lines_name, events_name, seen_name, what in _LABELED_KINDS:
        lines = CounterMetricFamily(lines_name, f"Kernel log: {what}.", labels=[label])
        events = CounterMetricFamily(events_name, f"Kernel log: bursts of {what}.", labels=[label])
        seen = GaugeMetricFamily(seen_name, f"Unix time of the last of the {what}.", labels=[label])
        if prefix == PATTERN_PREFIX:
            # Configured patterns only (0 from the start); counts restored for a pattern since removed are dropped.
            values = sorted(pattern_names)
        else:
            values = sorted({k[len(prefix):] for k in snap.lines if k.startswith(prefix)})
        for value in values:
            kind = prefix + value
            lines.add_metric([value], snap.lines.get(kind, 0))
            events.add_metric([value], snap.events.get(kind, 0))
            if kind in snap.last_seen_wall:
                seen.add_metric([value], snap.last_seen_wall[kind])
        families.extend((lines, events, seen))
    families.append(CounterMetricFamily(
        "memtel_kernel_kmsg_records", "Kernel log records read and classified this boot.", value=snap.records
    ))
    families.append(CounterMetricFamily(
        "memtel_kernel_kmsg_missed_records",
        "Kernel log records lost before they were read (ring-buffer overruns, sequence gaps).", value=snap.missed,
    ))
    families.append(CounterMetricFamily(
        "memtel_kernel_kmsg_state_write_failures",
        "Failed writes of the kmsg state file (the last good state is kept; kept across restarts).",
        value=snap.state_write_failures,
    ))
    families.append(CounterMetricFamily(
        "memtel_kernel_kmsg_ignored_test_lines",
        "Kernel log lines written by memtel's own test suite (they start with 'memtel-test:'), read this boot and "
        "counted nowhere else (kmsg.ignore_test_lines).",
        value=snap.ignored_test_lines,
    ))
    return families


class KmsgCollector:
    def __init__(self, follower: KmsgFollower, pattern_names: tuple[str, ...] = ()) -> None:
        self.follower = follower
        self.pattern_names = pattern_names

    def collect(self) -> list[Metric]:
        error = self.follower.error
        if error is not None:
            raise RuntimeError(error)
        return kmsg_families(self.follower.counts.snapshot(), self.pattern_names)
