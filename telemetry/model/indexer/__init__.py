"""The sparse indexer's model: its workload shape, planner, one logits launch, the one launch loop and replay.

- `shape.IndexerShape` / `REFERENCE_SHAPE`: the workload, validated once; every default comes from it.
- `planner`: the indexer's prefill planner, in the two width modes (`stock`, `fixed`).
- `launch.indexer_logits_launch`: one logits launch (the `lab-indexer` hook target).
- `backends`: `LaunchBackend` with `SimBackend` (the allocator simulator) and `CudaBackend`.
- `prefill.run_prefill`: the one launch loop (replay, truth capture, the demo's prediction, lab server ranks).
- `replay`: `memtel replay`. `forecast`: growth forecasts from an allocator snapshot; `fit`: the longest
  prefill that fits (it runs `forecast.simulate_prefill`); `forecast_cli`: `memtel forecast`, over both.

Pure and deterministic on the simulator; the CUDA paths import torch only when they run.
"""
