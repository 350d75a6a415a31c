"""`memtel flight show`: print or plot the flight recorder's records (this boot's or the previous one's).

    memtel flight show [--state-dir DIR] [--boot previous|current] [--last 120s] [--json|--csv] [--plot FILE.png]
    memtel flight show --file PATH ...       (any ring file, e.g. one the daemon moved aside as damaged)

The default output is a table of the signals that tell how a boot ended (headroom, MemAvailable,
contiguous free memory, unaccounted memory, GPU power, kernel-log counters); `--json` (one object per
line) and `--csv` give every recorded series. Torn or corrupt records are skipped with one line on
stderr; a ring whose header is damaged is read record by record (one line on stderr says so). Reading
never changes the ring.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TextIO

from telemetry.catalogue import metrics as catalogue
from telemetry.errors import ConfigError, RunError
from telemetry.flight.duration import parse_duration
from telemetry.flight.recorder import CURRENT_RING, HEADROOM_SERIES, PREVIOUS_RING
from telemetry.flight.ring import Record, RingContents, RingFormatError, read_ring
from telemetry.procfs.headroom import FALLING

if TYPE_CHECKING:  # matplotlib is imported only for --plot (the harness extra installs it)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

GIB = 1024**3
# (column title, series, scale): the table's columns; a series a record lacks shows as "-".
TABLE_COLUMNS = (
    ("headroom GiB", HEADROOM_SERIES, GIB),
    ("MemAvailable GiB", catalogue.MEM_AVAILABLE.series, GIB),
    ("contig>=2MiB GiB", catalogue.MEM_FREE_CONTIGUOUS.series, GIB),
    ("unaccounted GiB", catalogue.MEM_UNACCOUNTED.series, GIB),
    ("swap used GiB", catalogue.SWAP_USED.series, GIB),
)
POWER_PREFIX = catalogue.GPU_POWER.series + "{"   # a record's key: the series, then its labels (one per GPU)
NV_ERR_SERIES = catalogue.KERNEL_NV_ERR_NO_MEMORY[0].series   # the kernel lines, not their bursts
KERNEL_COUNTERS = (
    ("NV_ERR", NV_ERR_SERIES),
    ("OOM kills", catalogue.KERNEL_OOM_KILLS[0].series),
)


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="flight_action", metavar="COMMAND")
    show = actions.add_parser("show", help="print or plot the recorded records",
                              description="Print or plot the flight recorder's records.")
    where = show.add_mutually_exclusive_group()
    where.add_argument("--state-dir", metavar="DIR",
                       help="the daemon's state directory (default: the daemon's default; the ring is in DIR/flight)")
    where.add_argument("--file", metavar="PATH",
                       help="read this ring file instead (e.g. a ring the daemon moved aside: current.ring.corrupt-*)")
    show.add_argument("--boot", choices=("current", "previous"),
                      help="this boot's ring, or the ring of the boot before (default current; not with --file)")
    show.add_argument("--last", metavar="DURATION", help="only the last DURATION before the newest record (e.g. 120s)")
    output = show.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="one JSON object per record, every series")
    output.add_argument("--csv", action="store_true", help="CSV with one column per series")
    show.add_argument("--plot", metavar="FILE.png", help="also plot headroom and memory over time into FILE.png")


def ring_path(state_dir: str | None, boot: str) -> Path:
    if state_dir is None:
        from telemetry.paths import default_state_dir

        directory = default_state_dir() / "flight"
    else:
        directory = Path(state_dir) / "flight"
    return directory / (PREVIOUS_RING if boot == "previous" else CURRENT_RING)


def load(path: Path, boot: str | None) -> RingContents:
    if not os.path.lexists(path):
        hint = ("no ring of an earlier boot has been kept yet" if boot == "previous"
                else "expected a ring file written by the flight recorder" if boot is None
                else "the recorder runs when `memtel daemon` is given --state-dir")
        raise ConfigError(f"no flight ring at {path} ({hint})")
    try:
        return read_ring(path)
    except RingFormatError as exc:
        raise RunError(f"{path} is not a readable flight ring: {exc}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory; expected a ring file") from None
    except OSError as exc:
        raise RunError(f"cannot read {path}: {exc.strerror or exc}") from None


def select_last(records: list[Record], seconds: float | None) -> list[Record]:
    if seconds is None or not records:
        return records
    newest = records[-1].time
    return [r for r in records if r.time >= newest - seconds]


def _iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(timestamp)) + f".{int(timestamp % 1 * 1000):03d}Z"


def power_watts(record: Record) -> float | None:
    watts = [v for k, v in record.values.items() if k.startswith(POWER_PREFIX)]
    return sum(watts) if watts else None


def table(contents: RingContents, records: list[Record], out: TextIO) -> None:
    header = contents.header
    span = f"{_iso(records[0].time)} to {_iso(records[-1].time)}" if records else "no records"
    print(f"boot {header.boot_id}: {len(records)} record(s), {span}", file=out)
    titles = ["time (UTC)", *(t for t, _, _ in TABLE_COLUMNS), "GPU power W", *(t for t, _ in KERNEL_COUNTERS)]
    rows = []
    for record in records:
        row = [_iso(record.time)]
        for _, series, scale in TABLE_COLUMNS:
            value = record.values.get(series)
            row.append("-" if value is None else f"{value / scale:.2f}")
        power = power_watts(record)
        row.append("-" if power is None else f"{power:.1f}")
        for _, series in KERNEL_COUNTERS:
            value = record.values.get(series)
            row.append("-" if value is None else f"{value:.0f}")
        rows.append(row)
    widths = [max(len(titles[i]), *(len(r[i]) for r in rows)) if rows else len(titles[i]) for i in range(len(titles))]
    print("  ".join(t.rjust(w) for t, w in zip(titles, widths, strict=False)), file=out)
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=False)), file=out)


def as_json(contents: RingContents, records: list[Record], out: TextIO) -> None:
    for record in records:
        out.write(json.dumps({"seq": record.seq, "time": record.time, "boot_id": contents.header.boot_id,
                              "values": record.values}) + "\n")


def as_csv(records: list[Record], out: TextIO) -> None:
    keys = sorted({k for r in records for k in r.values})
    writer = csv.writer(out)
    writer.writerow(["seq", "time", *keys])
    for record in records:
        writer.writerow([record.seq, repr(record.time), *(repr(record.values[k]) if k in record.values else ""
                                                          for k in keys)])


MEM_TOTAL_SERIES = catalogue.MEM_TOTAL.series
# The floor of MemtelUnifiedHeadroomLow: dashboards/prometheus/memtel-alerts.yml records it as
# memtel:unified_headroom_low_threshold_bytes (tests/daemon/test_flight_plot.py holds the two together).
HEADROOM_LOW_FLOOR_BYTES = 4 * GIB


def headroom_floor_bytes(records: list[Record]) -> float | None:
    """The floor of MemtelUnifiedHeadroomFalling (below it a fall counts): `floor_ratio` × MemTotal of the newest
    record that has MemTotal; None where no record has it."""
    for record in reversed(records):
        total = record.values.get(MEM_TOTAL_SERIES)
        if total is not None:
            return FALLING.floor_ratio * total
    return None


def plot(contents: RingContents, records: list[Record], path: str) -> None:
    target = Path(path)
    if target.is_dir() or not target.name:
        raise ConfigError(f"--plot {path}: expected a file name (e.g. last-boot.png), got a directory")
    if not target.parent.is_dir():
        raise ConfigError(f"--plot {path}: the directory {target.parent} does not exist")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RunError("--plot needs matplotlib, which the harness extra installs: pip install 'memtel[harness]'") \
            from None
    if not records:
        raise RunError("--plot: no records to plot")
    figure = draw(plt, contents, records)
    try:
        figure.savefig(target)
    except OSError as exc:
        raise RunError(f"--plot {path}: cannot write: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)


def draw(plt: ModuleType, contents: RingContents, records: list[Record]) -> Figure:
    """The plot's figure: headroom on top of the other memory series, the falling-alert floor, NV_ERR marks,
    GPU power on a second axis drawn beneath the first."""
    newest = records[-1].time
    seconds = [r.time - newest for r in records]
    figure: Figure
    axes: Axes
    figure, axes = plt.subplots(figsize=(10, 5))  # plt is matplotlib.pyplot
    # The headroom often equals MemAvailable or the contiguous memory: it is drawn on top (zorder), thick and
    # dashed, and the others thin beneath it, so it is never hidden under them.
    for title, series, scale in TABLE_COLUMNS[:4]:
        points = [(s, r.values[series] / scale) for s, r in zip(seconds, records, strict=False) if series in r.values]
        if not points:
            continue
        style = ({"color": "black", "linewidth": 2.4, "linestyle": (0, (6, 3)), "zorder": 5}
                 if series == HEADROOM_SERIES else {"linewidth": 1.2, "alpha": 0.85, "zorder": 3})
        axes.plot([p[0] for p in points], [p[1] for p in points], label=title.replace(" GiB", ""), **style)
    axes.axhline(HEADROOM_LOW_FLOOR_BYTES / GIB, color="tab:red", linestyle="--", linewidth=1.3, zorder=4,
                 label=f"headroom floor ({HEADROOM_LOW_FLOOR_BYTES / GIB:g} GiB, MemtelUnifiedHeadroomLow)")
    floor = headroom_floor_bytes(records)
    if floor is not None:
        axes.axhline(floor / GIB, color="tab:purple", linestyle=":", linewidth=1.5, zorder=4,
                     label=f"falling-alert floor ({FALLING.floor_ratio:.0%} of MemTotal)")
    nv_err = [(s, r.values.get(NV_ERR_SERIES)) for s, r in zip(seconds, records, strict=False)]
    for (_, before), (s, after) in itertools.pairwise(nv_err):
        if before is not None and after is not None and after > before:
            axes.axvline(s, color="red", alpha=0.3, linewidth=1)
    axes.set_xlabel("seconds before the last record")
    axes.set_ylabel("GiB")
    axes.set_title(f"memtel flight recorder, boot {contents.header.boot_id} (red: NV_ERR_NO_MEMORY lines)")
    axes.grid(alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    power = [(s, power_watts(r)) for s, r in zip(seconds, records, strict=False)]
    if any(w is not None for _, w in power):
        twin = axes.twinx()
        twin.plot([s for s, w in power if w is not None], [w for _, w in power if w is not None], color="gray",
                  linestyle=":", label="GPU power (right axis)")
        twin.set_ylabel("GPU power W")
        # A twin axis is drawn over the first one: put the memory series back on top (transparent background).
        axes.set_zorder(twin.get_zorder() + 1)
        axes.patch.set_visible(False)
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    axes.legend(handles, labels, loc="best")
    figure.tight_layout()
    return figure


def run(args: argparse.Namespace) -> int:
    if args.flight_action != "show":
        raise ConfigError("choose an action: show (see memtel flight show --help)")
    seconds = parse_duration(args.last, "--last") if args.last is not None else None
    if args.file is not None:
        if args.boot is not None:
            raise ConfigError("--boot chooses a ring in the state directory; --file names the ring itself: "
                              "give one of them")
        path = Path(args.file)
        contents = load(path, None)
    else:
        path = ring_path(args.state_dir, args.boot or "current")
        contents = load(path, args.boot or "current")
    if contents.header_damage is not None:
        print(f"memtel flight: warning: {path}: the header is damaged ({contents.header_damage}); "
              f"{len(contents.records)} record(s) whose own checksums hold were recovered (boot id unknown)",
              file=sys.stderr)
    if contents.corrupt or contents.problems:
        print(f"memtel flight: warning: {path}: skipped {contents.corrupt} torn or corrupt record(s)"
              + (f" ({'; '.join(contents.problems)})" if contents.problems else ""), file=sys.stderr)
    records = select_last(contents.records, seconds)
    if args.plot:
        plot(contents, records, args.plot)
    if args.json:
        as_json(contents, records, sys.stdout)
    elif args.csv:
        as_csv(records, sys.stdout)
    else:
        table(contents, records, sys.stdout)
    return 0
