"""Prefix caching like vLLM's: hashes over full blocks, a repeated prefix is not prefilled again."""

from __future__ import annotations

import httpx

from harness.labserver.prefix_cache import PrefixCache, block_hashes
from tests.support.prom import metric


def test_block_hashes_chain_over_full_blocks_only():
    a = block_hashes(list(range(40)), block_size=16)
    assert len(a) == 2  # the 8-token tail is not a full block
    b = block_hashes(list(range(32)) + [7] * 8, block_size=16)
    assert a == b
    c = block_hashes([99, *list(range(1, 40))], block_size=16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash (chained)


def test_lookup_hits_the_longest_cached_prefix_and_keeps_the_last_token_to_compute():
    cache = PrefixCache(capacity_blocks=100, block_size=16)
    prompt = list(range(64))
    assert cache.lookup(prompt).cached_tokens == 0
    cache.commit(cache.lookup(prompt).hashes)
    # The same prompt: at most the blocks before its last token are cached (vLLM computes one token).
    assert cache.lookup(prompt).cached_tokens == 48
    assert cache.lookup([*prompt, 1000, 1001]).cached_tokens == 64
    assert cache.lookup(list(range(40)) + [5] * 30).cached_tokens == 32
    assert cache.lookup([1, *prompt[1:]]).cached_tokens == 0


def test_least_recently_used_blocks_are_evicted():
    cache = PrefixCache(capacity_blocks=4, block_size=16)
    first, second = list(range(48)), list(range(1000, 1048))
    cache.commit(cache.lookup(first).hashes)   # 3 blocks
    cache.commit(cache.lookup(second).hashes)  # 3 more: the oldest two of `first` go
    assert len(cache) == 4
    assert cache.lookup([*second, 1]).cached_tokens == 48
    assert cache.lookup([*first, 1]).cached_tokens == 0  # its first block was evicted, so nothing chains


def test_server_does_not_prefill_a_repeated_prefix(lab_server):
    url = lab_server.url
    launches = lambda: metric(url + "/metrics", "memtel_lab_indexer_launches_total") or 0
    calls = lambda: metric(lab_server.rank_url(0), "memtel_hook_calls_total") or 0
    prompt = " ".join(f"prefix{i}" for i in range(5000))
    before_launches, before_calls = launches(), calls()
    first = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60).json()
    cold_launches, cold_calls = launches() - before_launches, calls() - before_calls
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # 5,000 tokens in 1,024-token chunks: 5 chunk steps x 4 layers, one launch each (stock, under budget
    # until 4,096 tokens, then split: the 5th chunk's 1,024 x 1,250 x 4 B > 4 MiB is two launches).
    assert cold_calls == 4 * (4 + 2)
    second = httpx.post(url + "/v1/completions", json={"prompt": prompt + " more words here", "max_tokens": 1},
                        timeout=60).json()
    warm_launches, warm_calls = launches() - before_launches - cold_launches, calls() - before_calls - cold_calls
    assert second["usage"]["prompt_tokens"] == 5003
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 4992  # 312 full blocks of 16
    # Only 11 new tokens: one chunk step x 4 layers, at the kv length of the whole prompt (5,003 // 4).
    assert warm_calls == 4 * 1
    assert warm_launches == warm_calls * lab_server.ranks and cold_launches == cold_calls * lab_server.ranks
    hits = metric(url + "/metrics", "vllm:prefix_cache_hits_total")
    assert hits is not None and hits >= 4992
    # A different first word: nothing is reused.
    third = httpx.post(url + "/v1/completions", json={"prompt": "other " + prompt, "max_tokens": 1}, timeout=60).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reset = httpx.post(url + "/reset_prefix_cache")
    assert reset.status_code == 200
    again = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
