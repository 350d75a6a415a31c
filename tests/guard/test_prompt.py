"""A prompt's tokens bounded from above (bytes, template allowance) and below (words), and bad bodies."""

from __future__ import annotations

import pytest

from telemetry.guard.prompt import CHAT_MESSAGE_TOKENS, CHAT_TEMPLATE_TOKENS, PromptError, measure, parse_body


def test_a_text_prompt_is_bounded_by_its_utf8_bytes_and_its_words():
    size = measure("/v1/completions", {"prompt": "héllo wörld  ok"})
    assert (size.most_tokens, size.least_tokens, size.exact) == (17, 3, False)
    assert size.tokenize_body == {"prompt": "héllo wörld  ok"}


def test_token_ids_are_exact_and_need_no_tokenize():
    size = measure("/v1/completions", {"prompt": [5, 6, 7]})
    assert (size.most_tokens, size.least_tokens, size.exact, size.tokenize_body) == (3, 3, True, None)


def test_a_batch_adds_its_prompts_and_their_special_tokens():
    size = measure("/v1/completions", {"prompt": ["a b", [1, 2, 3], "c"], "model": "m"})
    assert (size.most_tokens, size.least_tokens) == (3 + 3 + 1, 2 + 3 + 1)
    assert size.tokenize_body == {"prompt": "a b\nc", "model": "m"}
    assert size.counted_tokens == 3 + 2  # the ids, and begin/end tokens of the second text prompt


def test_chat_adds_the_template_allowance_and_what_else_a_template_renders():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi there"}]}]
    size = measure("/v1/chat/completions", {"messages": messages, "tools": [{"name": "f"}]})
    rest = len('{"role": "system"}') + len('{"role": "user"}')
    assert size.most_tokens == CHAT_TEMPLATE_TOKENS + 2 * CHAT_MESSAGE_TOKENS + 8 + 8 + rest + len('[{"name": "f"}]')
    assert size.least_tokens == 4
    assert size.tokenize_body is not None and size.tokenize_body["messages"] == messages


@pytest.mark.parametrize(("raw", "words"), [
    (b"", "empty"), (b"  \n", "empty"), (b"\xc3\x28", "not UTF-8"), (b'{"a": ', "malformed JSON"),
    (b"[" * 100_000, "malformed JSON"), (b'"text"', "must be a JSON object"),
])
def test_bodies_that_are_not_a_json_object(raw, words):
    with pytest.raises(PromptError, match=words):
        parse_body(raw)


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/completions", {}, "`prompt` is missing"),
    ("/v1/completions", {"prompt": 5}, "must be a string"),
    ("/v1/completions", {"prompt": []}, "must be a string"),
    ("/v1/completions", {"prompt": [1, "a"]}, "must be a string"),
    ("/v1/chat/completions", {}, "`messages` is missing"),
    ("/v1/chat/completions", {"messages": []}, "non-empty list"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "must be an object"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "role must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text must be"),
])
def test_bodies_the_guard_cannot_size(path, body, words):
    with pytest.raises(PromptError, match=words):
        measure(path, body)


@pytest.mark.parametrize("text", ["", " ", "a", " a", "a ", "a  b\tc\n\nd\r\x0be\x0cf", "héllo  wörld", "\u3000x y",
                                  "a\x1cb", "\xa0a\xa0b"])
def test_count_words_is_bytes_split(text):
    from telemetry.guard.prompt import count_words

    data = text.encode("utf-8")
    assert count_words(data) == len(data.split())
