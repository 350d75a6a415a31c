"""The lab server (`memtel lab serve`): a vLLM-compatible server whose ranks make the indexer's allocations."""
