"""Prompt construction: exact token counts in <= 3 counting calls, deterministic, unique per seed."""

from __future__ import annotations

import json
import math
import re

import pytest

from harness.ab.prompts import WORDS, PromptError, answer_found, build_prompt, load_words


class Counter:
    """A local stand-in for /tokenize that counts its calls (the real server is used in the vLLM tests)."""

    def __init__(self, count) -> None:
        self.count, self.calls = count, 0

    def __call__(self, text: str) -> int:
        self.calls += 1
        return self.count(text)


def word_level(text: str) -> int:  # the test model's tokenizer: one whitespace-separated word = one token
    return len(text.split())


def word_level_with_bos(text: str) -> int:
    return len(text.split()) + 1


def subword(text: str) -> int:  # BPE-like: words split in pieces, punctuation apart, a BOS token
    return 1 + sum(math.ceil(len(piece) / 3) for piece in re.findall(r"\w+|[^\w\s]", text))


@pytest.mark.parametrize("count", [word_level, word_level_with_bos, subword], ids=lambda f: f.__name__)
@pytest.mark.parametrize("target", [300, 4_000, 100_000, 200_000])
def test_exact_token_count_in_at_most_three_calls(count, target):
    counter = Counter(count)
    prompt = build_prompt(target, seed=3, count_tokens=counter)
    assert count(prompt.text) == target
    assert prompt.prompt_tokens == target
    assert prompt.tokenize_calls == counter.calls <= 3


def test_same_seed_same_text_other_seed_or_repeat_differs_from_the_start():
    a = build_prompt(2_000, seed=1, count_tokens=word_level)
    assert build_prompt(2_000, seed=1, count_tokens=word_level).text == a.text
    for other in (build_prompt(2_000, seed=2, count_tokens=word_level),
                  build_prompt(2_000, seed=1, count_tokens=word_level, repeat=1)):
        # vLLM's prefix cache hashes blocks of 16 tokens: the very first block must already differ.
        assert a.text.split()[:16] != other.text.split()[:16]
        assert a.answer != other.answer or a.needle != other.needle or a.text != other.text


def test_needle_sits_at_its_depth_and_the_question_ends_the_prompt():
    prompt = build_prompt(10_000, seed=5, count_tokens=word_level, needle_depth=0.5)
    position = prompt.text.index(prompt.needle) / len(prompt.text)
    assert 0.4 < position < 0.6
    assert prompt.answer in prompt.needle
    assert prompt.text.rstrip().endswith(f"Question: {prompt.question}\nAnswer:")
    early = build_prompt(10_000, seed=5, count_tokens=word_level, needle_depth=0.1)
    assert early.text.index(early.needle) / len(early.text) < 0.2


def test_answer_found_in_a_reply():
    assert answer_found("123456", " The code is 123,456.")
    assert answer_found("123456", "123456")
    assert not answer_found("123456", "12345 6x")


def test_too_small_a_target_is_a_clear_error():
    with pytest.raises(PromptError, match="below this prompt's fixed part"):
        build_prompt(10, seed=1, count_tokens=word_level)


def test_a_tokenizer_that_never_converges_fails_after_the_call_limit():
    def even_only(text: str) -> int:  # every word two tokens: an odd count cannot be reached
        return 2 * len(text.split())

    with pytest.raises(PromptError, match="could not reach 5001 tokens in 4 /tokenize calls"):
        build_prompt(5_001, seed=1, count_tokens=even_only, max_calls=4)


def test_word_level_vocab_prompts_differ_token_by_token_so_the_prefix_cache_cannot_hit(tmp_path):
    """Found with the test model: its WordLevel vocabulary has no English words, so English filler was
    all [UNK], every prompt the same token sequence, and vLLM's prefix cache hit on the "cold" steps."""
    vocab_words = [a + b + c for a in "kltmnrsv" for b in "aeiou" for c in ("ka", "lo", "mi", "ne")]
    vocab = {w: i for i, w in enumerate(["[UNK]", *vocab_words])}
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
    words = load_words(tokenizer_json)
    assert set(words) == set(vocab_words)

    def ids(text: str) -> list[int]:
        return [vocab.get(w, 0) for w in text.split()]

    english = [ids(build_prompt(1_000, seed, word_level).text) for seed in (1, 2)]
    assert english[0][:16] == english[1][:16]  # the bug: the same first cache block
    own = [ids(build_prompt(1_000, seed, word_level, words=words).text) for seed in (1, 2)]
    assert own[0][:16] != own[1][:16]
    assert sum(i != 0 for i in own[0]) > 0.9 * len(own[0])  # nearly every token is a real word


def test_load_words_from_a_text_file(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text(" ".join(WORDS) + " x 123 ok!")
    assert load_words(path) == tuple(WORDS)
