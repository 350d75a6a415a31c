"""A prompt's tokens bounded from above (bytes, template allowance) and below (words), and bad bodies."""

from __future__ import annotations

import base64
import json
import time

import pytest

from telemetry.admission.prompt import (
    CHAT_COMPLETIONS,
    CHAT_MESSAGE_TOKENS,
    CHAT_TEMPLATE_TOKENS,
    COMPLETIONS,
    SPECIAL_TOKENS_PER_PROMPT,
    PromptError,
    measure,
    parse_body,
)

CHAT = "/v1/chat/completions"
S = SPECIAL_TOKENS_PER_PROMPT


def _json_len(value):
    return len(json.dumps(value, ensure_ascii=False).encode())


def test_a_text_prompt_is_bounded_by_its_utf8_bytes_its_special_tokens_and_its_words():
    size = measure("/v1/completions", {"prompt": "héllo wörld  ok"})
    assert (size.most_tokens, size.least_tokens, size.exact) == (17 + S, 3, False)
    assert size.tokenize_body == {"prompt": "héllo wörld  ok"} and size.engine_only is None


def test_token_ids_are_exact_and_need_no_tokenize():
    size = measure("/v1/completions", {"prompt": [5, 6, 7]})
    assert (size.most_tokens, size.least_tokens, size.exact, size.tokenize_body) == (3, 3, True, None)


def test_a_batch_adds_its_prompts_and_each_prompts_special_tokens():
    size = measure("/v1/completions", {"prompt": ["a b", [1, 2, 3], "c"], "model": "m"})
    assert (size.most_tokens, size.least_tokens) == (3 + 3 + 1 + 2 * S, 2 + 3 + 1)
    assert size.tokenize_body == {"prompt": "a b\nc", "model": "m"}
    assert size.counted_tokens == 3 + S + 1  # the ids; the second text prompt's specials and a possible merge


def test_a_batch_of_two_million_empty_prompts_is_not_bounded_at_zero():
    """The review's `[""] * 2,000,000` was bounded at 0 tokens: each prompt prefills at least one token."""
    started = time.perf_counter()
    size = measure("/v1/completions", {"prompt": [""] * 2_000_000})
    assert size.least_tokens == 2_000_000 and size.most_tokens == 2_000_000 * S
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("part", [
    {"type": "refusal", "refusal": "no " * 50},
    {"type": "input_text", "text": "no " * 50},
    {"type": "thinking", "thinking": "no " * 50},
])
def test_every_text_content_part_counts(part):
    """A `refusal` part was admitted uncounted (the review): every text-bearing part counts, with its fields."""
    size = measure(CHAT, {"messages": [{"role": "assistant", "content": [part]}]})
    rest = _json_len({"role": "assistant"})
    assert size.most_tokens == CHAT_TEMPLATE_TOKENS + CHAT_MESSAGE_TOKENS + _json_len(part) + 1 + rest
    assert size.least_tokens == 50 and size.engine_only is None


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "prompt_embeds", "data": "AAAA"},
    {"type": "something_new", "text": "x"},
    {"image_url": {"url": "https://example.com/a.png"}},  # no type: vLLM reads it as an image
])
def test_parts_that_bytes_cannot_bound_are_counted_by_the_engine(part):
    size = measure(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
    assert size.engine_only is not None and "messages[0].content[1]" in size.engine_only
    assert size.tokenize_body is not None and size.tokenize_body["messages"][0]["content"][1] == part


def test_chat_counts_everything_a_template_may_render():
    tools = [{"type": "function", "function": {"name": "f", "description": "d " * 30}}]
    documents = [{"title": "t", "text": "doc " * 40}]
    kwargs = {"enable_thinking": True, "system_hint": "be brief " * 10}
    body = {"messages": [{"role": "user", "content": "hi", "name": "ann"}], "tools": tools, "documents": documents,
            "chat_template_kwargs": kwargs, "tool_choice": "auto", "temperature": 0.5, "max_tokens": 9}
    size = measure(CHAT, body)
    rendered = _json_len(tools) + _json_len(documents) + _json_len(kwargs) + _json_len("auto")
    assert size.most_tokens == (CHAT_TEMPLATE_TOKENS + CHAT_MESSAGE_TOKENS + 2
                                + _json_len({"role": "user", "name": "ann"}) + rendered)
    assert size.engine_only is None
    # /tokenize gets the same template inputs (vLLM passes `documents` to the template as a keyword argument),
    # and what its /tokenize does not take (tool_choice) is counted here on top of its count.
    assert size.tokenize_body == {"messages": body["messages"], "add_generation_prompt": True, "tools": tools,
                                  "chat_template_kwargs": {**kwargs, "documents": documents}}
    assert size.counted_tokens == _json_len("auto")


@pytest.mark.parametrize(("field", "value"), [
    ("chat_template", "{% for m in messages %}{{ m.content * 1000 }}{% endfor %}"),
    ("mm_processor_kwargs", {"num_crops": 16}),
    ("a_field_nobody_knows", "x"),
])
def test_fields_bytes_cannot_bound_send_chat_to_the_engine(field, value):
    size = measure(CHAT, {"messages": [{"role": "user", "content": "hi"}], field: value})
    assert size.engine_only is not None and field in size.engine_only
    assert size.tokenize_body is not None and size.tokenize_body[field] == value


def test_an_unknown_completion_field_sends_it_to_the_engine_with_the_field():
    size = measure("/v1/completions", {"prompt": "hi", "rag_context": "lots of text"})
    assert size.engine_only is not None and "rag_context" in size.engine_only
    assert size.tokenize_body == {"prompt": "hi", "rag_context": "lots of text"}
    assert not size.fits_by_bound(10**9)


def test_continue_final_message_tokenizes_without_a_generation_prompt():
    size = measure(CHAT, {"messages": [{"role": "assistant", "content": "Once"}], "continue_final_message": True})
    assert size.tokenize_body is not None
    assert (size.tokenize_body["add_generation_prompt"], size.tokenize_body["continue_final_message"]) == (False, True)


def test_prompt_embeds_are_bounded_by_their_bytes_and_cannot_be_counted_by_tokenize():
    embeds = base64.b64encode(b"\0" * 3000).decode()
    size = measure("/v1/completions", {"prompt": "hello", "prompt_embeds": embeds})
    assert size.most_tokens == 5 + S + 3000 and size.least_tokens == 1 + 1
    assert (size.countable, size.tokenize_body) == (False, None)
    alone = measure("/v1/completions", {"prompt_embeds": [embeds, embeds]})
    assert (alone.most_tokens, alone.least_tokens, alone.param) == (6000, 2, "prompt_embeds")
    with pytest.raises(PromptError, match="prompt_embeds"):
        measure("/v1/completions", {"prompt_embeds": "not base64!"})


def test_a_fill_in_the_middle_suffix_counts():
    size = measure("/v1/completions", {"prompt": "def f(", "suffix": "    return x\n"})
    assert size.most_tokens == 6 + S + 13 + S and size.counted_tokens == 13 + S


def test_one_word_and_many_spaces_is_counted_before_it_holds_its_bytes():
    """One word and 399,999 spaces held 400,000 tokens for its whole prefill (the review)."""
    padded = measure("/v1/completions", {"prompt": "word" + " " * 399_999})
    assert padded.fits_by_bound(401_244) and padded.count_to_hold(401_244)
    assert not padded.count_to_hold(10_000_000)  # a small share of a big rank: holding the bound is cheap
    prose = measure("/v1/completions", {"prompt": "word " * 100})
    assert not prose.count_to_hold(10_000)  # a small share: the bound is held, no /tokenize


def test_seven_byte_words_that_would_hold_most_of_the_rank_are_counted_first():
    """57,000 seven-byte words held 399,001 tokens of a 401,244-token rank for a whole non-streamed answer (issue
    41): other prompts waited for tokens it did not have. Counted first, it holds what /tokenize says."""
    words = measure("/v1/completions", {"prompt": "abcdef " * 57_000})
    assert words.fits_by_bound(401_244) and words.count_to_hold(401_244)


@pytest.mark.parametrize(("raw", "words"), [
    (b"", "empty"), (b"  \n", "empty"), (b"\xc3\x28", "not UTF-8"), (b'{"a": ', "malformed JSON"),
    (b"[" * 100_000, "malformed JSON"), (b'"text"', "must be a JSON object"),
    (b'{"prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", "unreadable JSON.*digits"),
])
def test_bodies_that_are_not_a_json_object(raw, words):
    with pytest.raises(PromptError, match=words) as caught:
        parse_body(raw)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/completions", {}, "`prompt` is missing"),
    ("/v1/completions", {"prompt": 5}, "must be a string"),
    ("/v1/completions", {"prompt": []}, "must be a string"),
    ("/v1/completions", {"prompt": [1, "a"]}, "must be a string"),
    ("/v1/completions", {"prompt": "a", "suffix": 3}, "`suffix` must be a string"),
    (CHAT, {}, "`messages` is missing"),
    (CHAT, {"messages": []}, "non-empty list"),
    (CHAT, {"messages": ["hi"]}, "must be an object"),
    (CHAT, {"messages": [{"content": "hi"}]}, "role must be a string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text must be"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": 3}]}]}, "refusal must be"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}, "must be an object"),
])
def test_bodies_the_guard_cannot_size(path, body, words):
    with pytest.raises(PromptError, match=words):
        measure(path, body)


@pytest.mark.parametrize("text", ["", " ", "a", " a", "a ", "a  b\tc\n\nd\r\x0be\x0cf", "héllo  wörld", "\u3000x y",
                                  "a\x1cb", "\xa0a\xa0b"])
def test_count_words_is_bytes_split(text):
    from telemetry.admission.prompt import count_words

    data = text.encode("utf-8")
    assert count_words(data) == len(data.split())


def test_a_chat_prompt_is_sized_as_messages_by_its_text_parts():
    size = measure(CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": [{"text": "hello there"}]}]})
    assert size.param == "messages" and size.exact is False
    assert size.texts == (b"hello there",) and size.engine_only is None   # a part with `text` and no `type`


def test_prompt_embeds_that_are_not_base64_strings_are_refused():
    with pytest.raises(PromptError) as error:
        measure(COMPLETIONS, {"prompt_embeds": []})
    assert str(error.value) == "`prompt_embeds` must be a base64 string or a non-empty list of them"


def test_a_responses_request_is_sized_as_the_chat_it_renders_to():
    tools = [{"type": "function", "name": "f"}]
    size = measure("/v1/responses", {"model": "m", "instructions": "be brief", "input": "one two three",
                                     "tools": tools, "text": {"format": {"type": "text"}}})
    assert size.tokenize_body is not None and size.param == "input" and size.model == "m"
    assert size.tokenize_body["messages"] == [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "one two three"}]
    assert size.tokenize_body["model"] == "m" and size.tokenize_body["tools"] == [{"type": "function", "name": "f"}]
    text_bytes = len(json.dumps({"format": {"type": "text"}}).encode())   # `text` rendered: counted by its bytes
    assert size.counted_tokens == text_bytes and size.least_tokens == 5  # the words of both messages


def test_a_responses_tool_item_is_bounded_by_its_json_and_gives_no_words():
    item = {"type": "function_call_output", "call_id": "c1", "output": "forty two words " * 10}
    size = measure("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a b"}]},
                                               item]})
    assert size.tokenize_body is not None
    assert size.tokenize_body["messages"][1] == {"role": "tool", "content": json.dumps(item, ensure_ascii=False)}
    assert size.least_tokens == 2   # the item's words are not the prompt's (the template may write less of it)
    assert size.most_tokens >= len(json.dumps(item).encode()) + 2


@pytest.mark.parametrize("body, says", [
    ({"model": "m"}, "`input` is missing: expected a string or a non-empty list of input items"),
    ({"input": []}, "`input` must be a string or a non-empty list of input items"),
    ({"input": "x", "instructions": 3}, "`instructions` must be a string"),
    ({"input": ["x"]}, "input[0] must be an object"),
    ({"input": "x", "previous_response_id": "r1"}, "`previous_response_id` continues a stored conversation"),
])
def test_a_responses_request_the_guard_cannot_size_is_one_line(body, says):
    with pytest.raises(PromptError) as caught:
        measure("/v1/responses", body)
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value)
