"""kmsg collector: renders the kernel-log follower's counts. Fails while the log cannot be read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from telemetry.catalogue import metrics as catalogue
from telemetry.daemon.kmsg.classify import NV_ERR_NO_MEMORY, NVRM_ERROR, OOM_KILL, PATTERN_PREFIX, XID_PREFIX
from telemetry.daemon.kmsg.counts import CountsSnapshot
from telemetry.daemon.kmsg.follower import KmsgFollower
from telemetry.daemon.registry import register

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig

# kind -> its (lines counter, events counter, last-seen gauge)
_PLAIN_KINDS = (
    (NV_ERR_NO_MEMORY, catalogue.KERNEL_NV_ERR_NO_MEMORY),
    (NVRM_ERROR, catalogue.KERNEL_NVRM_ERRORS),
    (OOM_KILL, catalogue.KERNEL_OOM_KILLS),
)
# kind prefix -> the same, labelled by the rest of the kind (the Xid code, the pattern's name)
_LABELED_KINDS = (
    (XID_PREFIX, catalogue.KERNEL_XID),
    (PATTERN_PREFIX, catalogue.KERNEL_PATTERN),
)


def kmsg_families(snap: CountsSnapshot, pattern_names: tuple[str, ...] = ()) -> list[Metric]:
    families: list[Metric] = []
    for kind, (lines_family, events_family, seen_family) in _PLAIN_KINDS:
        # These counters always exist (0 until a line comes), so rate() and increase() work from the start.
        families.append(lines_family.new(snap.lines.get(kind, 0)))
        families.append(events_family.new(snap.events.get(kind, 0)))
        if kind in snap.last_seen_wall:
            families.append(seen_family.new(snap.last_seen_wall[kind]))
    for prefix, (lines_family, events_family, seen_family) in _LABELED_KINDS:
        lines, events, seen = lines_family.new(), events_family.new(), seen_family.new()
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
    families.append(catalogue.KMSG_RECORDS.new(snap.records))
    families.append(catalogue.KMSG_MISSED_RECORDS.new(snap.missed))
    families.append(catalogue.KMSG_STATE_WRITE_FAILURES.new(snap.state_write_failures))
    families.append(catalogue.KMSG_IGNORED_TEST_LINES.new(snap.ignored_test_lines))
    return families


class KmsgCollector:
    def __init__(self, follower: KmsgFollower, pattern_names: tuple[str, ...] = ()) -> None:
        self.follower = follower
        self.pattern_names = pattern_names

    def start(self) -> None:
        """Read the saved counts and start following the kernel log (after the state directory is made safe)."""
        self.follower.load_state()
        self.follower.start()

    def stop(self) -> None:
        self.follower.stop()

    def collect(self) -> list[Metric]:
        error = self.follower.error
        if error is not None:
            raise RuntimeError(error)
        return kmsg_families(self.follower.counts.snapshot(), self.pattern_names)


@register("kmsg", order=80, help="NVIDIA driver errors, Xids and OOM kills in the kernel log (`/dev/kmsg`)",
          uses_state_dir=True)
def build(config: DaemonConfig) -> KmsgCollector:
    from telemetry.daemon.kmsg.classify import Classifier
    from telemetry.daemon.kmsg.counts import KmsgCounts
    from telemetry.daemon.kmsg.position import default_position_path
    from telemetry.daemon.kmsg.state import STATE_FILE_NAME, read_boot_id

    kmsg = config.kmsg
    follower = KmsgFollower(
        kmsg.path, Classifier(kmsg.patterns, ignore_test_lines=kmsg.ignore_test_lines),
        KmsgCounts(kmsg.burst_window_seconds, kmsg.max_xid_codes),
        state_path=config.state_dir / STATE_FILE_NAME,
        boot_id=read_boot_id(str(config.proc_root / "sys/kernel/random/boot_id")),
        position_path=default_position_path(config.state_dir),
    )
    return KmsgCollector(follower, tuple(p.name for p in kmsg.patterns))
