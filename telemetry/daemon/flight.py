"""The flight recorder inside `memtel daemon`: built from the config, fed by the daemon's collectors.

A record holds every series the daemon's collectors export (the same code path as a scrape, run by the
recorder's own thread once an interval, without counting as a scrape), plus the last values of the
configured local hook exporters.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from telemetry.flight.hooks import HookScraper
from telemetry.flight.recorder import FlightRecorder, series_values

if TYPE_CHECKING:
    from telemetry.daemon.registry import DaemonCollectors
    from telemetry.daemon.settings import DaemonConfig

FLIGHT_DIR = "flight"
COLLECTOR_NAME = "flight"


class DaemonFlight:
    def __init__(self, config: DaemonConfig) -> None:
        from telemetry.daemon.kmsg.state import read_boot_id

        flight = config.flight
        self.recorder = FlightRecorder(
            config.state_dir / FLIGHT_DIR, read_boot_id(str(config.proc_root / "sys/kernel/random/boot_id")),
            duration_seconds=flight.duration_seconds, interval_seconds=flight.interval_seconds,
        )
        self.hooks = HookScraper(flight.hook_targets, flight.interval_seconds) if flight.hook_targets else None

    def start(self, wrapper: DaemonCollectors) -> None:
        hooks = self.hooks
        interval = self.recorder.interval_seconds
        used = [0.0]  # monotonic time the last record's values were collected

        def sample() -> tuple[float, dict[str, float]]:
            # A scrape within the last interval (Prometheus or an agent at 1 s) already collected every
            # source: record that rather than run the collectors a second time. Each scrape is recorded once.
            last = wrapper.last_scrape
            if last is not None and last[0] > used[0] and time.monotonic() - last[0] < interval:
                used[0] = last[0]
                timestamp, values = last[1], series_values(last[2])
            else:
                # From now on a scrape that began earlier is not recorded: records stay in time order.
                used[0], timestamp = time.monotonic(), time.time()
                values = series_values(wrapper.collect_sources(skip=(COLLECTOR_NAME,)))
            if hooks is not None:
                values.update(hooks.latest())
            return timestamp, values

        if hooks is not None:
            hooks.start()
        self.recorder.start(sample)

    def stop(self) -> None:
        if self.hooks is not None:
            self.hooks.stop()
        self.recorder.stop()
