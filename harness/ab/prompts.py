"""Prompts of an exact token count, from deterministic text, with a fact to retrieve.

Each prompt is a header unique to its (seed, repeat), filler sentences drawn from a seeded generator,
a needle sentence (a six-digit code) at `needle_depth` of the filler, a run of pad words, and the
question. The same (seed, repeat) gives the same text on every machine, so both arms get identical
prompts; different seeds differ from the first words on, so vLLM's prefix cache never hits.

Exact length: word-separated text tokenizes additively (tokenizers split at whitespace before they
merge), so the count is measured once, the filler is resized by the measured tokens-per-word, and the
small remainder is filled with one-token pad words. That takes 2-3 calls of the counting function
(the server's /tokenize) for any length; `count_tokens` is injected so tests can use a local counter.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from telemetry.errors import RunError
from telemetry.limits import MAX_PREFILL_TOKENS, MAX_WORDS_FILE_BYTES

# Common English words: real tokenizers give each one or two tokens, which keeps the
# tokens-per-word ratio stable and the needle retrievable by a real model.
WORDS: tuple[str, ...] = (
    "the", "river", "city", "morning", "light", "stone", "garden", "window", "market", "winter", "summer",
    "evening", "house", "road", "field", "bridge", "village", "forest", "mountain", "valley", "harbor",
    "island", "castle", "tower", "library", "school", "teacher", "student", "doctor", "farmer", "baker",
    "painter", "writer", "singer", "sailor", "soldier", "traveler", "child", "mother", "father", "brother",
    "sister", "friend", "neighbor", "stranger", "king", "queen", "prince", "merchant", "captain", "engineer",
    "gardener", "keeper", "walked", "carried", "opened", "closed", "found", "lost", "built", "painted", "wrote",
    "read", "watched", "heard", "followed", "crossed", "climbed", "counted", "gathered", "measured", "repaired",
    "visited", "remembered", "forgot", "planted", "cleaned", "finished", "started", "waited", "answered",
    "asked", "explained", "noticed", "shared", "bought", "sold", "borrowed", "returned", "discovered",
    "quietly", "slowly", "carefully", "early", "late", "often", "rarely", "always", "suddenly", "finally",
    "together", "alone", "again", "old", "new", "small", "large", "quiet", "busy", "bright", "dark", "warm",
    "cold", "green", "blue", "red", "yellow", "wooden", "narrow", "wide", "ancient", "modern", "simple",
    "careful", "happy", "tired", "gentle", "patient", "clever", "honest", "famous", "hidden", "distant",
    "letter", "book", "map", "lamp", "table", "chair", "door", "key", "coin", "box", "bag", "rope", "boat",
    "cart", "wheel", "clock", "bell", "cup", "bread", "apple", "cheese", "fish", "salt", "tea", "water", "fire",
    "wind", "rain", "snow", "cloud", "star", "moon", "sun", "tree", "flower", "grass", "hill", "lake", "sea",
    "shore", "path", "wall", "gate", "roof", "floor", "room", "kitchen", "hall", "office", "station", "museum",
    "after", "before", "during", "under", "over", "near", "beside", "behind", "across", "through", "along",
    "around", "between",
)

COLORS = ("amber", "cobalt", "crimson", "emerald", "ivory", "jade", "ochre", "scarlet", "silver", "violet")
PLACES = ("archive", "cellar", "harbor", "lighthouse", "mill", "observatory", "orchard", "quarry", "tower", "vault")
PAD_WORD = "a"
DEFAULT_MAX_CALLS = 8


class PromptError(RunError):
    """The prompt could not be brought to the requested token count."""


@dataclass(frozen=True)
class Prompt:
    text: str
    prompt_tokens: int  # as counted by the server's tokenizer (the same count the server's usage reports)
    needle: str       # the fact sentence
    answer: str       # what a correct reply contains
    question: str
    seed: int
    repeat: int
    tokenize_calls: int
    filler_words: int
    pad_words: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class _Parts:
    header: str
    needle: str
    question: str
    answer: str
    rng_key: str


def load_words(path: str | Path) -> tuple[str, ...]:
    """Filler words from a text file (whitespace-separated) or a Hugging Face tokenizer.json's vocabulary.

    Needed for models whose tokenizer maps English words to one unknown token (a test model's
    word-level vocabulary): every prompt would be the same token sequence and the prefix cache would hit.
    The file must be a regular file of at most MAX_WORDS_FILE_BYTES, UTF-8 (PromptError otherwise).
    """
    from telemetry.safefs import FileTooLargeError, read_capped

    path = Path(path)
    try:
        data = read_capped(path, MAX_WORDS_FILE_BYTES, follow_symlinks=True)
    except FileTooLargeError:
        raise PromptError(f"{path} is larger than {MAX_WORDS_FILE_BYTES // 2**20} MiB; expected a words file or a "
                          "tokenizer.json") from None
    except OSError as exc:
        raise PromptError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"{path} is not UTF-8 text (byte {exc.start}); expected a words file or a "
                          "tokenizer.json") from None
    words = [k.lstrip("\u0120\u2581") for k in _vocabulary(text, path)] if path.suffix == ".json" else text.split()
    words = list(dict.fromkeys(w for w in words if w.isascii() and w.isalpha() and len(w) >= 2))
    if len(words) < 50:
        raise PromptError(f"{path}: only {len(words)} usable words (letters only, 2+ characters); need at least 50")
    return tuple(words)


def _vocabulary(text: str, path: Path) -> list[str]:
    """The vocabulary's entries of a tokenizer.json (`model.vocab`: a mapping, or a list of [piece, score])."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, a giant integer, deep nesting
        raise PromptError(f"{path}: not a readable tokenizer.json ({type(exc).__name__})") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        return [k for k in vocab if isinstance(k, str)]
    if isinstance(vocab, list):
        return [entry[0] for entry in vocab if isinstance(entry, list) and entry and isinstance(entry[0], str)]
    raise PromptError(f"{path}: no model.vocab (a mapping or a list) in this tokenizer.json")


def _parts(seed: int, repeat: int, words: Sequence[str]) -> _Parts:
    rng = random.Random(f"memtel-needle/{seed}/{repeat}")
    color, place = rng.choice(COLORS), rng.choice(PLACES)
    code = f"{rng.randrange(100000, 1000000)}"
    # Seeded words up front: the very first cache block differs between prompts whatever the tokenizer.
    opening = " ".join(rng.choice(words) for _ in range(8))
    return _Parts(
        header=f"Record {seed}-{repeat} {rng.randrange(10**9):09d} {opening}. "
               "Read the whole record, then answer the question at the end.",
        needle=f"The secret code of the {color} {place} is {code}.",
        question=f"What is the secret code of the {color} {place}? Answer with the number only.",
        answer=code,
        rng_key=f"memtel-filler/{seed}/{repeat}",
    )


class _Filler:
    """The seeded word stream; the first n words are always the same, so resizing only appends or cuts."""

    def __init__(self, key: str, vocabulary: Sequence[str], sentences: bool) -> None:
        self._rng = random.Random(key)
        self._vocabulary = vocabulary
        self._sentences = sentences  # capitals and periods only where the words are plain English
        self._words: list[str] = []
        self._sentence_left = 0

    def words(self, n: int) -> list[str]:
        while len(self._words) < n:
            word = self._rng.choice(self._vocabulary)
            if self._sentences:
                if self._sentence_left == 0:
                    self._sentence_left = self._rng.randint(8, 16)
                    word = word.capitalize()
                self._sentence_left -= 1
                if self._sentence_left == 0:
                    word += "."
            self._words.append(word)
        return self._words[:n]


def _render(parts: _Parts, filler: _Filler, n_words: int, pad: int, depth: float) -> str:
    words = filler.words(n_words)
    cut = round(len(words) * depth)
    body = [*words[:cut], parts.needle, *words[cut:], *([PAD_WORD] * pad)]
    return f"{parts.header}\n\n{' '.join(body)}\n\nQuestion: {parts.question}\nAnswer:"


def build_prompt(target_tokens: int, seed: int, count_tokens: Callable[[str], int], *, repeat: int = 0,
                 needle_depth: float = 0.5, max_calls: int = DEFAULT_MAX_CALLS,
                 words: Sequence[str] | None = None) -> Prompt:
    """A prompt of exactly `target_tokens` tokens as `count_tokens` counts them.

    `words`: the filler vocabulary (default: common English words, see `load_words`).
    """
    if not 1 <= target_tokens <= MAX_PREFILL_TOKENS:
        raise PromptError(f"a prompt of {target_tokens} tokens: expected 1 to {MAX_PREFILL_TOKENS:,}")
    vocabulary = tuple(words) if words else WORDS
    parts = _parts(seed, repeat, vocabulary)
    filler = _Filler(parts.rng_key, vocabulary, sentences=not words)
    calls = 0

    def count(n: int, pad: int) -> int:
        nonlocal calls
        calls += 1
        return int(count_tokens(_render(parts, filler, n, pad, needle_depth)))

    fixed_words = len(_render(parts, filler, 0, 0, needle_depth).split())
    n, pad = max(0, target_tokens - fixed_words), 0  # first guess: one token per word
    c = count(n, pad)
    if c != target_tokens and n > 0:
        # Resize by the measured tokens per word, aiming a little short: the remainder is padded.
        per_word = c / (n + fixed_words)
        step_words = (target_tokens - c) / per_word
        margin = math.ceil(2 * math.sqrt(abs(step_words))) + 1 if per_word != 1.0 else 0
        n = max(0, n + math.floor(step_words) - margin)
        c = count(n, pad)
    pad_cost = 1.0
    while c != target_tokens:
        if calls >= max_calls:
            break
        diff = target_tokens - c
        if diff > 0:
            new_pad = pad + max(1, round(diff / pad_cost))
            new_n = n
        else:
            take = max(1, round(-diff / pad_cost))
            if take <= pad:
                new_pad, new_n = pad - take, n
            else:  # cut filler words (each is at least one token), then pad up again
                new_n, new_pad = max(0, n - (take - pad)), 0
        if new_n < 0 or (new_n == n and new_pad == pad):
            break
        new_c = count(new_n, new_pad)
        if new_n == n and new_pad != pad and new_c != c:
            pad_cost = max(1.0, (new_c - c) / (new_pad - pad))
        n, pad, c = new_n, new_pad, new_c
    if c != target_tokens and n == 0 and pad == 0 and c > target_tokens:
        raise PromptError(f"{target_tokens} tokens is below this prompt's fixed part ({c} tokens with no filler)")
    if c != target_tokens:
        raise PromptError(f"could not reach {target_tokens} tokens in {calls} /tokenize calls (last count {c} "
                          f"with {n} filler and {pad} pad words): the tokenizer does not count the pad word "
                          f"{PAD_WORD!r} as one token")
    return Prompt(
        text=_render(parts, filler, n, pad, needle_depth), prompt_tokens=c, needle=parts.needle,
        answer=parts.answer, question=parts.question, seed=seed, repeat=repeat, tokenize_calls=calls,
        filler_words=n, pad_words=pad,
    )


def answer_found(prompt_answer: str, reply: str) -> bool:
    """The reply names the code as a number of its own (thousands commas allowed)."""
    return prompt_answer in {n.replace(",", "") for n in re.findall(r"\d[\d,]*\d|\d", reply)}
