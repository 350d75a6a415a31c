"""telemetry/validate.py: the one walker behind the ladder, daemon and web config files (no files, no servers)."""

from __future__ import annotations

import pytest

from telemetry.errors import ConfigError
from telemetry.validate import (
    DAEMON,
    LADDER,
    Field,
    Section,
    Validator,
    boolean,
    choice,
    integer,
    number,
    optional,
    path_text,
)


class OwnError(ConfigError):
    pass


def message(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


def test_an_error_names_the_file_and_the_field_path_and_has_the_callers_type():
    v = Validator("ladder.yaml", error_type=OwnError)
    with pytest.raises(OwnError, match=r"^ladder.yaml: steps\[2\].tokens: expected an integer >= 1,000, got 10$"):
        v.integer(10, "steps[2].tokens", 1000)
    assert str(Validator(None, top="top level").fail("", "bad")) == "top level: bad"
    assert str(Validator("f.yml").fail("", "bad")) == "f.yml: bad"


@pytest.mark.parametrize(("wording", "value", "expected"), [
    (LADDER, 0, "expected an integer >= 1, got 0"),
    (LADDER, 20, "expected an integer <= 10, got 20"),
    (LADDER, "many", "expected an integer, got str 'many'"),
    (LADDER, True, "expected an integer, got bool True"),
    (LADDER, 10**40, "expected an integer <= 10, got an integer of 133 bits"),
    (DAEMON, 0, "expected an integer from 1 to 10, got 0"),
    (DAEMON, "many", "expected an integer from 1 to 10, got str 'many'"),
    (DAEMON, 2.0, "expected an integer from 1 to 10, got float 2.0"),
])
def test_integer_bounds_in_each_wording(wording, value, expected):
    assert message(lambda: Validator("f", wording=wording).integer(value, "k", 1, 10)) == f"f: k: {expected}"


@pytest.mark.parametrize(("wording", "value", "expected"), [
    (LADDER, float("nan"), "expected a finite number, got nan"),
    (LADDER, 3, "expected a number in [0, 2], got 3"),
    (LADDER, 2**60, "expected a number of at most 2^53"),
    (DAEMON, float("nan"), "expected a finite number from 0 to 2, got nan"),
    (DAEMON, float("inf"), "expected a finite number from 0 to 2, got inf"),
    (DAEMON, "soon", "expected a number from 0 to 2, got str 'soon'"),
])
def test_numbers_must_be_finite_and_in_bounds(wording, value, expected):
    assert expected in message(lambda: Validator("f", wording=wording).number(value, "k", 0, 2))


def test_a_good_number_comes_back_as_float_and_an_integer_as_int():
    for wording in (LADDER, DAEMON):
        v = Validator("f", wording=wording)
        assert v.number(1, "k", 0, 2) == 1.0 and isinstance(v.number(1, "k", 0, 2), float)
        assert v.integer(3, "k", 1, 10) == 3


def test_unknown_keys_one_at_its_path_or_all_at_the_sections():
    data = {"path": "/x", "pattern": 1, "aaa": 2}
    assert message(lambda: Validator("f").mapping(data, "kmsg", (), ("path",))) == \
        "f: kmsg.pattern: unknown key 'pattern'; valid keys here: path"
    assert message(lambda: Validator("f", wording=DAEMON).mapping(data, "kmsg", (), ("path",))) == \
        "f: kmsg: unknown key(s) aaa, pattern; valid keys: path"


def test_required_keys_unsupported_keys_and_non_mappings():
    v = Validator("f")
    assert message(lambda: v.mapping({"a": None}, "s", ("a",))) == "f: s.a: missing (required)"
    assert message(lambda: v.mapping({"rate_limit": 1}, "", (), ("x",), {"rate_limit": "not supported"})) == \
        "f: rate_limit: not supported"
    assert message(lambda: v.mapping(["a"], "s", ("a",), ("b",))) == "f: s: expected a mapping with keys a, b, got list"


def test_text_choice_boolean_and_path():
    v = Validator("f")
    assert "contains a NUL character" in message(lambda: v.text("a\0b", "k"))
    assert "expected at most 3 characters, got 4" in message(lambda: v.text("abcd", "k", 3))
    assert "expected a non-empty string, got str '  '" in message(lambda: v.text("  ", "k"))
    assert message(lambda: v.choice("x", "order", ("ABAB", "AABB"))) == "f: order: expected one of ABAB, AABB, got 'x'"
    assert "got list" in message(lambda: v.choice(["ABAB"], "order", ("ABAB",)))
    assert message(lambda: v.boolean("no", "k")) == "f: k: expected true or false, got str 'no'"
    assert message(lambda: v.path_text("", "state_dir")) == "f: state_dir: expected a path, got str ''"
    assert v.path_text("/x", "p") == "/x" and v.choice("ABAB", "o", ("ABAB",)) == "ABAB"


def test_items_bounds_a_list():
    v = Validator("f")
    assert v.items([], "l", "things", max_items=2, allow_empty=True) == []
    assert "expected a non-empty list of things, got list" in message(lambda: v.items([], "l", "things", max_items=2))
    assert "expected at most 2 items, got 3" in message(lambda: v.items([1, 2, 3], "l", "things", max_items=2))


# A section is declared once: keys in order, each with its check and default.
PROTECT = Section({
    "enabled": Field(boolean, default=False),
    "min_headroom_mib": Field(integer(0, 1 << 20), default=1024),
    "cooldown_s": Field(number(0, 3600), default=60.0),
    "mode": Field(choice("observe", "act"), default="observe"),
    "log": Field(optional(path_text), default=None, null_is_default=True),
})


def test_a_declared_section_gives_defaults_checked_values_and_field_paths():
    v = Validator("daemon.yaml", wording=DAEMON)
    assert PROTECT.read(v, None, "protect") == {"enabled": False, "min_headroom_mib": 1024, "cooldown_s": 60.0,
                                                 "mode": "observe", "log": None}
    values = PROTECT.read(v, {"enabled": True, "min_headroom_mib": 2048, "log": None}, "protect")
    assert values["enabled"] is True and values["min_headroom_mib"] == 2048 and values["log"] is None
    assert message(lambda: PROTECT.read(v, {"min_headroom_mib": -1}, "protect")) == \
        f"daemon.yaml: protect.min_headroom_mib: expected an integer from 0 to {1 << 20}, got -1"
    assert message(lambda: PROTECT.read(v, {"mode": "kill"}, "protect")) == \
        "daemon.yaml: protect.mode: expected one of observe, act, got 'kill'"
    assert message(lambda: PROTECT.read(v, {"enable": True}, "protect")).startswith(
        "daemon.yaml: protect: unknown key(s) enable; valid keys: enabled, min_headroom_mib, cooldown_s")
    assert PROTECT.keys == ("enabled", "min_headroom_mib", "cooldown_s", "mode", "log")


def test_a_required_field_and_a_nested_section():
    inner = Section({"name": Field(lambda v, value, path: v.text(value, path))})
    outer = Section({"inner": Field(inner.read, default={"name": "x"})}, null_is_empty=False)
    v = Validator("f")
    assert outer.read(v, {}, "") == {"inner": {"name": "x"}}
    assert message(lambda: outer.read(v, {"inner": {}}, "")) == "f: inner.name: missing (required)"
    assert message(lambda: outer.read(v, None, "")).startswith("f: expected a mapping with keys inner, got nothing")


def test_url_needs_http_a_host_and_a_number_port_and_loses_its_trailing_slash():
    v = Validator("f")
    assert v.url("http://127.0.0.1:8000/", "u") == "http://127.0.0.1:8000"
    assert "expected an http(s) URL" in message(lambda: v.url("spark-a:9101", "nodes.spark-a"))
    assert "expected an http(s) URL" in message(lambda: v.url("http://[::1:80", "u"))  # unclosed bracket
    assert message(lambda: v.url("http://h:99999", "u")) == (
        "f: u: expected an http(s) URL such as http://127.0.0.1:8000, got 'http://h:99999', which has no valid host "
        "and port")
