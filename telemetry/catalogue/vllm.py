"""vLLM's own series that memtel reads (the A/B harness's samplers, the stall rule) and that the lab server
exports under the same names, labels and help, as vLLM does. Not memtel's: `FAMILIES` (metrics.py) leaves them
out, and their names and help are vLLM's (vllm/v1/metrics/loggers.py), typed here once.
"""

from __future__ import annotations

from telemetry.catalogue.family import Family, counter, gauge, histogram

_VLLM = ("model_name", "engine")
PROMPT_TOKENS = counter("vllm:prompt_tokens", "Number of prefill tokens processed.", _VLLM, source="vllm")
GENERATION_TOKENS = counter("vllm:generation_tokens", "Number of generation tokens processed.", _VLLM,
                            source="vllm")
PROMPT_TOKENS_CACHED = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (prefix cache hits).",
                               _VLLM, source="vllm")
PREFIX_CACHE_QUERIES = counter("vllm:prefix_cache_queries",
                               "Prefix cache queries, in terms of number of queried tokens.", _VLLM, source="vllm")
PREFIX_CACHE_HITS = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            _VLLM, source="vllm")
REQUEST_SUCCESS = counter("vllm:request_success", "Count of successfully processed requests.",
                          (*_VLLM, "finished_reason"), source="vllm")
TIME_TO_FIRST_TOKEN = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                _VLLM, source="vllm")
E2E_REQUEST_LATENCY = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                _VLLM, source="vllm")
REQUEST_PREFILL_TIME = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", _VLLM, source="vllm")
NUM_REQUESTS_RUNNING = gauge("vllm:num_requests_running", "Number of requests in model execution batches.", _VLLM,
                             source="vllm")
NUM_REQUESTS_WAITING = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", _VLLM,
                             source="vllm")
ITERATION_TOKENS = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", _VLLM,
                             source="vllm")


def _collect() -> dict[str, Family]:
    return {value.name: value for value in globals().values() if isinstance(value, Family)}


VLLM_FAMILIES: dict[str, Family] = _collect()

__all__ = ["E2E_REQUEST_LATENCY", "GENERATION_TOKENS", "ITERATION_TOKENS", "NUM_REQUESTS_RUNNING",
           "NUM_REQUESTS_WAITING", "PREFIX_CACHE_HITS", "PREFIX_CACHE_QUERIES", "PROMPT_TOKENS",
           "PROMPT_TOKENS_CACHED", "REQUEST_PREFILL_TIME", "REQUEST_SUCCESS", "TIME_TO_FIRST_TOKEN",
           "VLLM_FAMILIES"]
