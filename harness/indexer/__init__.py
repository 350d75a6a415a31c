"""The sparse indexer's model: its prefill planner, one logits launch and the replay of a prefill's launches.

Pure and deterministic on the simulator; the CUDA paths import torch only when they run.
"""
