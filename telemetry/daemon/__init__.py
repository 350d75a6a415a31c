"""`memtel daemon`: the node exporter for host memory, swap, PSI, NVML, serving processes and kernel-log errors.

Parts: config (flags + YAML), collectors/ (one per source), kmsg/ (kernel-log follower), registry
(the wrapper that times collectors), server (/metrics, /healthz), main (the subcommand).
"""
