"""The guard's URL and /v1/models parsing at their edges: what mutation testing found unchecked
(docs/testing.md, "Mutation testing"). Pure functions, no servers."""

from __future__ import annotations

import json

import pytest

from telemetry.errors import ConfigError
from telemetry.guard.refusal import MAX_MODELS_BYTES, parse_models
from telemetry.guard.replicas import engines, hook_targets


def _upstream(text):
    [(upstream, _hooks)] = engines(text, "http://h:9200", None, None)
    return upstream


@pytest.mark.parametrize(("text", "port", "tls"), [("http://vm", 80, False), ("https://vm", 443, True),
                                                   ("https://vm:8443/", 8443, True), ("vm:8000", 8000, False)])
def test_an_upstream_without_a_port_gets_its_schemes(text, port, tls):
    upstream = _upstream(text)
    assert (upstream.host, upstream.port, upstream.tls, upstream.path) == ("vm", port, tls, "")


@pytest.mark.parametrize("text", ["http://vm:8000/?x=1", "http://vm:8000/v1", "ftp://vm", "http://u:secret@vm:8000",
                                  "vm"])
def test_an_upstream_that_is_not_a_base_url_is_refused_with_what_is_expected(text):
    with pytest.raises(ConfigError, match=r"^--upstream: .*expected the engine's base URL") as caught:
        _upstream(text)
    assert "secret" not in str(caught.value)


def test_a_hook_without_a_port_gets_its_schemes():
    assert [h.port for h in hook_targets("https://vm,http://vm,vm:9400")] == [443, 80, 9400]
    with pytest.raises(ConfigError, match=r"^--hooks: 'vm' has no port; expected HOST:PORT or http\(s\)://"):
        hook_targets("vm")


def test_models_cards_that_are_not_objects_are_skipped_not_the_end():
    assert parse_models(json.dumps({"data": ["junk", {"id": "m", "max_model_len": 4096}]}).encode()) == {"m": 4096}


def test_a_models_answer_of_exactly_the_bound_is_read():
    data = json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode()
    assert parse_models(data.ljust(MAX_MODELS_BYTES)) == {"m": 4096}  # JSON allows the trailing spaces
    assert parse_models(data.ljust(MAX_MODELS_BYTES + 1)) == {}
