"""How many tokens a completion request's prompt holds, bounded from both sides without a tokenizer.

- Upper bound, `PromptSize.most_tokens`: a byte-level BPE token (GPT-2, Llama 3, Qwen, DeepSeek) and a
  SentencePiece piece with byte fallback cover at least one byte of UTF-8, so a text's byte count bounds
  its tokens; a list of token ids counts exactly. A chat request adds what its template writes around the
  messages, which is not in the request: `CHAT_TEMPLATE_TOKENS` for the template's fixed part (a default
  system prompt, the generation prompt) and `CHAT_MESSAGE_TOKENS` per message (role markers), plus the
  bytes of every role, name, tool call and tool definition the template renders. A template that writes
  more than that is the one case the bound misses (docs/guard.md, "How the prompt is counted").
- Lower bound, `PromptSize.least_tokens`: the whitespace-separated words of the text. Tokenizers that
  split text at whitespace before merging (the pre-tokenizers of GPT-2, Llama 3 and Qwen, SentencePiece's
  default `split_by_whitespace`, the lab's) never put two words in one token, so a prompt with more words
  than the limit is refused without asking the upstream to tokenize a megabyte.

A request the upstream would refuse as malformed is refused here first (`PromptError`, a 400), so nothing
is forwarded that the guard could not size.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

CHAT_TEMPLATE_TOKENS = 2048
CHAT_MESSAGE_TOKENS = 64

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


class PromptError(Exception):
    """A request body the guard cannot size; the message is one line for a 400."""


@dataclass(frozen=True)
class PromptSize:
    most_tokens: int  # no prompt of this request has more tokens than this (template allowance included)
    exact: bool  # token ids only: most_tokens is the count
    tokenize_body: dict[str, Any] | None  # what to ask the upstream's /tokenize for the count of the text
    counted_tokens: int = 0  # tokens counted here (ids, special tokens of a batch): add to /tokenize's
    texts: tuple[bytes, ...] = ()  # the prompt's text, UTF-8 (its words are counted only when needed)
    id_tokens: int = 0  # token ids among the prompts

    @functools.cached_property
    def least_tokens(self) -> int:
        """Every tokenizer that splits at whitespace gives at least this many: the words, plus the ids."""
        return self.id_tokens + sum(count_words(t) for t in self.texts)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; PromptError for anything else."""
    if not raw.strip():
        raise PromptError("the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"the request body is not UTF-8 (byte {exc.start}); expected a JSON object in UTF-8") \
            from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptError(f"malformed JSON in the request body: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    except RecursionError:
        raise PromptError("malformed JSON in the request body: nested too deeply") from None
    if not isinstance(body, dict):
        raise PromptError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def measure(path: str, body: dict[str, Any]) -> PromptSize:
    return _chat(body) if path == CHAT_COMPLETIONS else _completion(body)


# ASCII whitespace (what every whitespace-splitting tokenizer splits at) to 0, every other byte to 1: a word
# starts at each 0-to-1 step. Counting them in C is 2 to 3 times faster than bytes.split() on a 10 MB prompt.
_WORD_MASK = bytes(0 if byte in b" \t\n\r\x0b\x0c" else 1 for byte in range(256))


def count_words(text: bytes) -> int:
    """The whitespace-separated words of a UTF-8 text (as len(text.split()), without making them)."""
    mask = text.translate(_WORD_MASK)
    return mask.count(b"\x00\x01") + (1 if mask[:1] == b"\x01" else 0)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # JSON allows lone surrogates; they still take bytes


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion(body: dict[str, Any]) -> PromptSize:
    prompt = body.get("prompt")
    if prompt is None:
        raise PromptError("`prompt` is missing: expected a string, a list of strings or a list of token ids")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt  # a batch: its prompts are prefilled together, so their tokens add up
    else:
        raise PromptError("`prompt` must be a string, a list of strings, a list of token ids or a list of those")
    encoded = tuple(_utf8(p) for p in prompts if isinstance(p, str))
    ids = sum(len(p) for p in prompts if not isinstance(p, str))
    most = ids + sum(len(t) for t in encoded)
    if not encoded:
        return PromptSize(most, True, None, id_tokens=ids)
    texts = [p for p in prompts if isinstance(p, str)]
    # One /tokenize call for all the text; a batch's prompts each get their own special tokens, so two more
    # (begin and end) per extra prompt, and the token ids are counted here.
    counted = ids + 2 * (len(texts) - 1)
    tokenize: dict[str, Any] = {"prompt": "\n".join(texts)}
    if "model" in body:
        tokenize["model"] = body["model"]
    return PromptSize(most, False, tokenize, counted, encoded, ids)


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise PromptError(f"{where}[{j}] must be an object such as {{\"type\": \"text\", \"text\": ...}}")
            text = part.get("text")
            if part.get("type", "text") == "text" and not isinstance(text, str):
                raise PromptError(f"{where}[{j}].text must be a string")
            if isinstance(text, str):
                texts.append(text)
        return "\n".join(texts)
    raise PromptError(f"{where} must be a string or a list of content parts")


def _chat(body: dict[str, Any]) -> PromptSize:
    if "messages" not in body:
        raise PromptError("`messages` is missing: expected a non-empty list of {\"role\": ..., \"content\": ...}")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise PromptError("`messages` must be a non-empty list of {\"role\": ..., \"content\": ...}")
    most = CHAT_TEMPLATE_TOKENS
    texts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"messages[{i}] must be an object with `role` and `content`")
        role = message.get("role")
        if not isinstance(role, str):
            raise PromptError(f"messages[{i}].role must be a string")
        text = _utf8(_content_text(message.get("content"), f"messages[{i}].content"))
        texts.append(text)
        # What else of the message a template may render (role, name, tool calls) counts by its JSON bytes.
        rest = {k: v for k, v in message.items() if k != "content"}
        most += CHAT_MESSAGE_TOKENS + len(text) + len(json.dumps(rest, ensure_ascii=False).encode())
    for key in ("tools", "functions", "documents"):
        if body.get(key) is not None:
            most += len(json.dumps(body[key], ensure_ascii=False).encode())
    tokenize: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
    for key in ("model", "tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
        if key in body:
            tokenize[key] = body[key]
    return PromptSize(most, False, tokenize, texts=tuple(texts))


__all__ = ["CHAT_COMPLETIONS", "CHAT_MESSAGE_TOKENS", "CHAT_TEMPLATE_TOKENS", "COMPLETIONS", "PromptError",
           "PromptSize", "count_words", "measure", "parse_body"]
