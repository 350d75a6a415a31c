"""How many tokens a completion request's prompt holds, bounded from both sides without a tokenizer.

- Upper bound, `PromptSize.most_tokens`: a byte-level BPE token (GPT-2, Llama 3, Qwen, DeepSeek) and a
  SentencePiece piece with byte fallback cover at least one byte of UTF-8, so a text's byte count bounds
  its tokens; a list of token ids counts exactly. Each prompt of a batch adds `SPECIAL_TOKENS_PER_PROMPT`
  (the begin/end tokens a tokenizer adds to each sequence). A chat request adds what its template writes
  around the messages, which is not in the request: `CHAT_TEMPLATE_TOKENS` for the template's fixed part (a
  default system prompt, the generation prompt) and `CHAT_MESSAGE_TOKENS` per message (role markers), plus
  the JSON bytes of everything else a template may render: every field of every message and content part,
  `tools`, `documents`, `chat_template_kwargs`, `tool_choice`, `response_format`, `reasoning_effort` (JSON
  escapes only add bytes, so a value's JSON bytes bound the bytes of any string it holds).
- Lower bound, `PromptSize.least_tokens`: the whitespace-separated words of the text. Tokenizers that
  split text at whitespace before merging (the pre-tokenizers of GPT-2, Llama 3 and Qwen, SentencePiece's
  default `split_by_whitespace`, the lab's) never put two words in one token, so a prompt with more words
  than the limit is refused without asking the upstream to tokenize a megabyte. Every prompt of a batch
  counts at least one token: the engine refuses an empty one.
- What bytes cannot bound sets `PromptSize.engine_only` (why): an image, audio or video part (its tokens
  are the processor's, not its URL's bytes), a content part or request field the guard does not know, a
  request's own `chat_template` (a template can write anything). The guard then asks the engine's
  `/tokenize` with the same template inputs, never guesses. `prompt_embeds` cannot be counted by the engine's
  `/tokenize` either: they are bounded by their decoded bytes (an embedding row takes at least one byte), and
  `PromptSize.countable` is False, so one over the limit by that bound is refused (docs/guard.md).

A request the upstream would refuse as malformed is refused here first (`PromptError`, a 400), so nothing
is forwarded that the guard could not size.
"""

from __future__ import annotations

import binascii
import functools
import json
from dataclasses import dataclass
from typing import Any

CHAT_TEMPLATE_TOKENS = 2048
CHAT_MESSAGE_TOKENS = 64
# The special tokens a tokenizer adds to one sequence: a begin and an end token at most (Llama, Mistral and
# Gemma add a begin token, BERT-style post-processors a begin and an end, GPT-2 and Qwen none).
SPECIAL_TOKENS_PER_PROMPT = 2
# When the byte bound would hold more than 1/HOLD_COUNT_SHARE of the rank's limit, the prompt is counted by
# /tokenize before it is admitted, so it holds what its prefill needs, not its bytes (PromptSize.count_to_hold).
HOLD_COUNT_SHARE = 8

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
RESPONSES = "/v1/responses"

# Request fields that never reach the prompt (sampling, output shape, transport, scheduling: OpenAI's and
# vLLM's) or reach it only as what the allowances cover (special tokens, the generation prompt). Any field not
# here and not counted below makes the guard ask the engine.
_NOT_PROMPT = frozenset({
    "model", "max_tokens", "max_completion_tokens", "n", "best_of", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "length_penalty", "logit_bias", "logprobs",
    "top_logprobs", "prompt_logprobs", "logprob_token_ids", "seed", "stop", "stop_token_ids", "stream",
    "stream_options", "stream_interval", "echo", "user", "metadata", "store", "service_tier", "use_beam_search",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "bad_words", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "session_id", "return_tokens_as_token_ids",
    "return_token_ids", "return_token_offsets", "return_prompt_text", "routed_experts_prompt_start",
    "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "include_reasoning", "parallel_tool_calls", "watermarking",
    "add_special_tokens", "add_generation_prompt", "continue_final_message", "modalities", "prediction",
    "audio", "web_search_options", "max_prompt_tokens",
})
# Completions: `response_format` only constrains the output there.
_COMPLETION_FIELDS = frozenset({"prompt", "prompt_embeds", "suffix", "response_format"})
# Chat fields a template may render, bounded by their JSON bytes.
_CHAT_RENDERED = ("tools", "functions", "documents", "chat_template_kwargs", "tool_choice", "response_format",
                  "reasoning_effort")
# Of those, what vLLM's /tokenize does not take: counted here by their JSON bytes on top of its count.
_CHAT_NOT_TOKENIZED = ("functions", "tool_choice", "response_format")
# Fields that change a prompt's tokens in ways bytes cannot bound: only the engine can count.
_ENGINE_ONLY = ("chat_template", "mm_processor_kwargs", "media_io_kwargs", "mm_payload")
# Content parts whose tokens are the text they carry (vLLM's parsers: text, input/output text, thinking,
# refusal, a tool reference's name); any other part (image, audio, video, embeddings, unknown) is the engine's.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "thinking": "thinking",
               "refusal": "refusal", "tool_reference": "name"}
_TOKENIZE_CHAT = ("model", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
                  "add_special_tokens", "mm_processor_kwargs", "media_io_kwargs")


class PromptError(Exception):
    """A request body the guard cannot size; the message is one line for a 400."""


@dataclass(frozen=True)
class PromptSize:
    most_tokens: int  # no prompt of this request has more tokens than this (template allowance included)
    exact: bool  # token ids only: most_tokens is the count
    tokenize_body: dict[str, Any] | None  # what to ask the upstream's /tokenize for the count of the text
    counted_tokens: int = 0  # tokens counted here (ids, special tokens of a batch): add to /tokenize's
    texts: tuple[bytes, ...] = ()  # the prompt's text, UTF-8 (its words are counted only when needed)
    id_tokens: int = 0  # token ids among the prompts, and one token for each embedding input
    text_prompts: int = 0  # text prompts of a batch: each prefills at least one token (the engine refuses none)
    engine_only: str | None = None  # why only the engine can count it: most_tokens bounds the text, not all
    countable: bool = True  # False: /tokenize cannot count it either (prompt_embeds)
    model: object = None  # the request's `model`
    param: str = "prompt"  # the field that holds the prompt (a refusal's `param`)

    @functools.cached_property
    def least_tokens(self) -> int:
        """Every tokenizer that splits at whitespace gives at least this many: the words, plus the ids."""
        return self.id_tokens + max(self.text_prompts, sum(count_words(t) for t in self.texts))

    def fits_by_bound(self, limit_tokens: int) -> bool:
        """The byte bound proves it fits: no engine count is needed to admit it."""
        return self.engine_only is None and self.most_tokens <= limit_tokens

    def count_to_hold(self, rank_tokens: int) -> bool:
        """Admitted by its byte bound, it would hold more of the rank than its prefill needs: count it first.

        The bound is a byte a token; text has several bytes a token (English about four, seven-byte words, one
        word and 399,999 spaces), so a bound that takes more than 1/HOLD_COUNT_SHARE of the rank's limit would
        keep other requests waiting `in_prefill` for tokens this prompt does not have, for as long as its hold
        lasts (a whole answer when it is not streamed). One /tokenize is cheap beside such a prefill; below the
        share, holding the bound is cheaper than asking.
        """
        return (not self.exact and self.tokenize_body is not None and self.countable
                and self.most_tokens * HOLD_COUNT_SHARE > rank_tokens)


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
    except ValueError as exc:  # an integer of more than 4,300 digits, and any other value json cannot make
        raise PromptError(f"unreadable JSON in the request body: {str(exc)[:120]}; expected a JSON object of an "
                          "OpenAI completion request") from None
    if not isinstance(body, dict):
        raise PromptError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def measure(path: str, body: dict[str, Any]) -> PromptSize:
    try:
        if path == RESPONSES:
            return _responses(body)
        return _chat(body) if path == CHAT_COMPLETIONS else _completion(body)
    except (RecursionError, ValueError) as exc:  # a value too deep or too long to write back as JSON
        raise PromptError(f"the request cannot be sized: {type(exc).__name__}: {str(exc)[:120]}") from None


# ASCII whitespace (what every whitespace-splitting tokenizer splits at) to 0, every other byte to 1: a word
# starts at each 0-to-1 step. Counting them in C is 2 to 3 times faster than bytes.split() on a 10 MB prompt.
_WORD_MASK = bytes(0 if byte in b" \t\n\r\x0b\x0c" else 1 for byte in range(256))


def count_words(text: bytes) -> int:
    """The whitespace-separated words of a UTF-8 text (as len(text.split()), without making them)."""
    mask = text.translate(_WORD_MASK)
    return mask.count(b"\x00\x01") + (1 if mask[:1] == b"\x01" else 0)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # JSON allows lone surrogates; they still take bytes


def _json_bytes(value: Any) -> int:
    """Bytes of `value` as JSON: at least the bytes of every string in it (escapes only add)."""
    return len(_utf8(json.dumps(value, ensure_ascii=False)))


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _unknown(body: dict[str, Any], known: frozenset[str] | tuple[str, ...]) -> str | None:
    extra = sorted(k for k in body if k not in _NOT_PROMPT and k not in known)
    return f"fields the guard does not know ({', '.join(extra)[:120]})" if extra else None


def _embeds_bytes(embeds: Any) -> int:
    """Decoded bytes of `prompt_embeds` (base64 of serialized tensors); PromptError if they are not that."""
    items = embeds if isinstance(embeds, list) else [embeds]
    if not items or not all(isinstance(e, str) and e for e in items):
        raise PromptError("`prompt_embeds` must be a base64 string or a non-empty list of them")
    try:
        return sum(len(binascii.a2b_base64(e.encode("ascii"))) for e in items)
    except (binascii.Error, UnicodeEncodeError):
        raise PromptError("`prompt_embeds` must be base64 of serialized tensors") from None


def _completion(body: dict[str, Any]) -> PromptSize:
    prompt = body.get("prompt")
    embeds = body.get("prompt_embeds")
    if prompt is None and embeds is None:
        raise PromptError("`prompt` is missing: expected a string, a list of strings or a list of token ids")
    if prompt is None:
        prompts: list[Any] = []
    elif isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (set(map(type, prompt)) == {str} or all(
            isinstance(p, str) or _is_ids(p) for p in prompt)):
        prompts = prompt  # a batch: its prompts are prefilled together, so their tokens add up
    else:
        raise PromptError("`prompt` must be a string, a list of strings, a list of token ids or a list of those")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise PromptError("`suffix` must be a string")
    # A batch of two million prompts is joined and encoded once (C loops): its words are the join's, and its
    # bytes the join's less the newlines.
    texts = prompts if len(prompts) > 1 and set(map(type, prompts)) == {str} else \
        [p for p in prompts if isinstance(p, str)]
    ids = 0 if texts is prompts else sum(len(p) for p in prompts if not isinstance(p, str))
    joined = "\n".join(texts)
    encoded = _utf8(joined)
    # Each text prompt gets its special tokens (and prefills at least one token, or the engine refuses it).
    most = ids + len(encoded) - max(0, len(texts) - 1) + SPECIAL_TOKENS_PER_PROMPT * len(texts)
    # A fill-in-the-middle suffix is rendered into each prompt, with its own special tokens.
    fim = (len(_utf8(suffix)) + SPECIAL_TOKENS_PER_PROMPT) * len(prompts) if suffix else 0
    most += fim
    least_extra = ids
    countable = True
    if embeds is not None:
        # Each row of an embedding tensor (one token) takes at least one byte: a sound bound, far above the count.
        most += _embeds_bytes(embeds)
        least_extra += len(embeds) if isinstance(embeds, list) else 1
        countable = False
    engine_only = _unknown(body, _COMPLETION_FIELDS)
    if not texts and embeds is None and engine_only is None:
        return PromptSize(most, True, None, id_tokens=ids, model=body.get("model"))
    tokenize: dict[str, Any] | None = None
    counted = 0
    if texts or engine_only is not None:
        # One /tokenize call for all the text (joined by newlines); the token ids, the other prompts' special
        # tokens (and one more each where the join could merge two prompts' edges) and the suffix are counted
        # here. Fields the guard does not know go along, for an engine that renders them.
        counted = ids + (SPECIAL_TOKENS_PER_PROMPT + 1) * max(0, len(texts) - 1) + fim
        tokenize = {k: v for k, v in body.items() if k not in _NOT_PROMPT and k not in _COMPLETION_FIELDS}
        tokenize["prompt"] = joined
        for key in ("model", "add_special_tokens"):
            if key in body:
                tokenize[key] = body[key]
    return PromptSize(most, False, tokenize if countable else None, counted, (encoded,) if texts else (),
                      least_extra, len(texts), engine_only, countable, body.get("model"),
                      "prompt_embeds" if prompt is None else "prompt")


def _content(content: Any, where: str) -> tuple[bytes, int, str | None]:
    """(the text a tokenizer sees, the bytes that bound it with its part fields, why only the engine can count)."""
    if content is None:
        return b"", 0, None
    if isinstance(content, str):
        text = _utf8(content)
        return text, len(text), None
    if not isinstance(content, list):
        raise PromptError(f"{where} must be a string or a list of content parts")
    texts: list[bytes] = []
    bound, engine_only = 0, None
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise PromptError(f"{where}[{j}] must be an object such as {{\"type\": \"text\", \"text\": ...}}")
        # Without a `type`, vLLM reads a part by its fields (`image_url`, ...): text only if it has `text`.
        kind = part.get("type", "text" if "text" in part else None)
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            engine_only = engine_only or f"{where}[{j}] is a {str(kind)[:40]!r} part"
            continue
        value = part.get(key)
        if not isinstance(value, str):
            raise PromptError(f"{where}[{j}].{key} must be a string")
        texts.append(_utf8(value))
        bound += _json_bytes(part)  # the text and every other field of the part
    return b"\n".join(texts), bound + len(texts), engine_only


def _chat(body: dict[str, Any]) -> PromptSize:
    if "messages" not in body:
        raise PromptError("`messages` is missing: expected a non-empty list of {\"role\": ..., \"content\": ...}")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise PromptError("`messages` must be a non-empty list of {\"role\": ..., \"content\": ...}")
    most = CHAT_TEMPLATE_TOKENS
    texts = []
    engine_only = _unknown(body, (*_CHAT_RENDERED, *_ENGINE_ONLY, "messages"))
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"messages[{i}] must be an object with `role` and `content`")
        role = message.get("role")
        if not isinstance(role, str):
            raise PromptError(f"messages[{i}].role must be a string")
        text, bound, parts_only = _content(message.get("content"), f"messages[{i}].content")
        texts.append(text)
        engine_only = engine_only or parts_only
        # Whatever else of the message a template may render (role, name, tool calls, reasoning) counts by its
        # JSON bytes.
        rest = {k: v for k, v in message.items() if k != "content"}
        most += CHAT_MESSAGE_TOKENS + bound + _json_bytes(rest)
    for key in _CHAT_RENDERED:
        if body.get(key) is not None:
            most += _json_bytes(body[key])
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise PromptError("`chat_template_kwargs` must be an object")
    for key in _ENGINE_ONLY:
        if body.get(key) is not None or (kwargs and key in kwargs):
            engine_only = engine_only or f"`{key}` changes the prompt in ways only the engine can count"
    tokenize: dict[str, Any] = {k: v for k, v in body.items() if k not in _NOT_PROMPT and k not in _CHAT_RENDERED
                                and k not in _ENGINE_ONLY}
    # vLLM refuses add_generation_prompt beside continue_final_message.
    tokenize.update(messages=messages, add_generation_prompt=not body.get("continue_final_message"))
    for key in _TOKENIZE_CHAT:
        if key in body:
            tokenize[key] = body[key]
    # vLLM passes `documents` and `reasoning_effort` to the template as keyword arguments (its chat requests do
    # so; its /tokenize takes them only there).
    template_kwargs = dict(kwargs or {})
    template_kwargs.update({k: body[k] for k in ("documents", "reasoning_effort") if body.get(k) is not None})
    if template_kwargs:
        tokenize["chat_template_kwargs"] = template_kwargs
    counted = sum(_json_bytes(body[k]) for k in _CHAT_NOT_TOKENIZED if body.get(k) is not None)
    return PromptSize(most, False, tokenize, counted, texts=tuple(texts), engine_only=engine_only,
                      model=body.get("model"), param="messages")


# Responses: fields that never reach the prompt besides _NOT_PROMPT's; fields that continue a stored conversation or
# name a stored prompt (only the engine knows their tokens, and its /tokenize cannot count them) are refused.
_RESPONSES_NOT_PROMPT = frozenset({"max_output_tokens", "max_tool_calls", "include", "background", "truncation",
                                   "prompt_cache_key", "safety_identifier", "instructions", "input"})
_RESPONSES_STORED = ("previous_response_id", "conversation", "prompt")


def _responses(body: dict[str, Any]) -> PromptSize:
    """A /v1/responses request, sized as the chat it renders to (vLLM renders `instructions` and `input` through
    the chat template): `instructions` a system message, `input` a user message or a list of messages; a tool call
    or its output is a message of its JSON bytes (the template writes no more of it than its fields). Every other
    field a template may render (`tools`, `text`, `reasoning`, any unknown one) counts by its JSON bytes."""
    for key in _RESPONSES_STORED:
        if body.get(key) is not None:
            raise PromptError(f"`{key}` continues a stored conversation or prompt whose tokens the memtel guard "
                              "cannot count; send the whole `input` instead")
    if "input" not in body:
        raise PromptError("`input` is missing: expected a string or a non-empty list of input items")
    given = body["input"]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise PromptError("`instructions` must be a string")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    items: set[int] = set()  # messages made of an item's JSON: not words of the prompt (no lower bound from them)
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            if not isinstance(item, dict):
                raise PromptError(f"input[{i}] must be an object such as {{\"role\": \"user\", \"content\": ...}}")
            if "role" in item and item.get("type", "message") == "message":
                messages.append({"role": item["role"], "content": item.get("content")})
            else:  # a tool call, its output, a reasoning item: as text, its every field (an upper bound)
                items.add(len(messages))
                messages.append({"role": "tool", "content": json.dumps(item, ensure_ascii=False)})
    else:
        raise PromptError("`input` must be a string or a non-empty list of input items")
    chat: dict[str, Any] = {"messages": messages}
    for key in ("model", "tools", "tool_choice"):
        if body.get(key) is not None:
            chat[key] = body[key]
    size = _chat(chat)
    rest = [k for k in body if k not in _NOT_PROMPT and k not in _RESPONSES_NOT_PROMPT and k not in chat
            and body[k] is not None]
    extra = sum(_json_bytes(body[k]) for k in rest)
    return PromptSize(size.most_tokens + extra, False, size.tokenize_body, size.counted_tokens + extra,
                      texts=tuple(t for i, t in enumerate(size.texts) if i not in items),
                      engine_only=size.engine_only, model=body.get("model"), param="input")


__all__ = ["CHAT_COMPLETIONS", "CHAT_MESSAGE_TOKENS", "CHAT_TEMPLATE_TOKENS", "COMPLETIONS",
           "HOLD_COUNT_SHARE", "RESPONSES", "SPECIAL_TOKENS_PER_PROMPT", "PromptError", "PromptSize", "count_words",
           "measure", "parse_body"]
