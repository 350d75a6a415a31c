"""`memtel daemon`: the node exporter for host memory, swap, PSI, NVML, serving processes and kernel-log errors.

Parts: config (flags + YAML), patterns (user regexes, RE2), collectors/ (one per source), kmsg/
(kernel-log follower), registry (the wrapper that times collectors), main (the subcommand). /metrics and
/healthz are served by memtel's shared exporter server (telemetry/exporter/).
"""
