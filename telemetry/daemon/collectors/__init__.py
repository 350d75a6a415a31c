"""One collector per source. Each takes its paths (or library) as constructor arguments so tests
can point it at fixture files; `build_collectors(config)` in telemetry.daemon.main wires the defaults."""

NAMES = ("meminfo", "vmstat", "pressure", "buddyinfo", "headroom", "nvml", "processes", "kmsg")
