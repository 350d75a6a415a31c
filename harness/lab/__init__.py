"""The allocator lab: the indexer planner model, the caching-allocator simulator, the isolation
replay (`memtel replay`) and the lab server's parts.

Nothing here imports torch at import time; the CUDA paths import it when they run.
"""
