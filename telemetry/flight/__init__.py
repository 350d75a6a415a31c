"""The flight recorder: the node's last minutes on disk, readable after a crash or a reboot.

- `ring`: the file format (preallocated slots, one CRC-checked record each) and its reader;
- `recorder`: `FlightRecorder`, which writes one record per interval and keeps the previous boot's ring;
- `hooks`: the optional scraper of local hook exporters; `daemon`: the wiring into `memtel daemon`;
- `cli`: `memtel flight show`.
See docs/flight-recorder.md.
"""

from telemetry.flight.recorder import CURRENT_RING, PREVIOUS_RING, BootSummary, FlightRecorder
from telemetry.flight.ring import Record, RingContents, RingFormatError, read_ring

__all__ = ["CURRENT_RING", "PREVIOUS_RING", "BootSummary", "FlightRecorder", "Record", "RingContents",
           "RingFormatError", "read_ring"]
