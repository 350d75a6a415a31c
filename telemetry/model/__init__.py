"""The allocator and indexer model: PyTorch's caching-allocator simulator (`allocsim`) and the sparse
indexer's workload, planner and forecast (`indexer`).

It sits below both the hook (its live forecast) and the harness (lab server, replay, demo), and imports
only the bottom of `telemetry` (errors, limits, argtypes, allocator_counters, safefs): docs/architecture.md,
"Layers".
"""
