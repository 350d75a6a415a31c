"""The GPU capture tools: what the real CUDA caching allocator does, recorded as the model's test fixtures.

Each runs on a machine with a GPU (torch with CUDA) as `python3 -m telemetry.model.capture.<tool> --out DIR`:

- `truth`: op-by-op allocator truth for the simulator (tests/fixtures/allocator-truth);
- `snapshots`: live processes' snapshots with the next prefill's truth, and what-if histories
  (tests/fixtures/allocator-snapshots);
- `gc_histories`: allocator histories under garbage collection (tests/fixtures/allocator-gc-traces).

They sit above the allocator simulator and the indexer's model (they drive the indexer's launch loop on CUDA
and check against the simulator); nothing in the model imports them.
"""
