"""The guard's URL and /v1/models parsing at their edges: what mutation testing found unchecked
(docs/testing.md, "Mutation testing"). Pure functions, no servers."""

from __future__ import annotations

import json

import pytest

from telemetry.errors import ConfigError
from telemetry.guard.limit import HookTarget
from telemetry.guard.proxy import Upstream
from telemetry.guard.refusal import MAX_MODELS_BYTES, parse_models


@pytest.mark.parametrize(("text", "port", "tls"), [("http://vm", 80, False), ("https://vm", 443, True),
                                                   ("https://vm:8443/", 8443, True)])
def test_an_upstream_without_a_port_gets_its_schemes(text, port, tls):
    upstream = Upstream.parse(text)
    assert (upstream.host, upstream.port, upstream.tls) == ("vm", port, tls)


@pytest.mark.parametrize("text", ["http://vm:8000/?x=1", "http://vm:8000/v1", "ftp://vm", "http://u@vm:8000"])
def test_an_upstream_that_is_not_a_base_url_is_refused_with_what_is_expected(text):
    with pytest.raises(ConfigError, match="expected the engine's base URL"):
        Upstream.parse(text)


def test_a_hook_without_a_port_gets_its_schemes():
    assert (HookTarget.parse("https://vm").port, HookTarget.parse("http://vm").port) == (443, 80)
    with pytest.raises(ConfigError, match=r"expected http://HOST:PORT or https://HOST:PORT\[/metrics\]"):
        HookTarget.parse("vm:9400")


def test_models_cards_that_are_not_objects_are_skipped_not_the_end():
    assert parse_models(json.dumps({"data": ["junk", {"id": "m", "max_model_len": 4096}]}).encode()) == {"m": 4096}


def test_a_models_answer_of_exactly_the_bound_is_read():
    data = json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode()
    assert parse_models(data.ljust(MAX_MODELS_BYTES)) == {"m": 4096}  # JSON allows the trailing spaces
    assert parse_models(data.ljust(MAX_MODELS_BYTES + 1)) == {}
