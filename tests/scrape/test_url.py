"""telemetry/scrape/url.py: the one parser of the URLs memtel reads from (ledger, top, flight, guard)."""

from __future__ import annotations

import base64

import pytest

from telemetry.errors import ConfigError
from telemetry.scrape import DAEMON_PORT, Endpoint, parse_base_url, parse_url, parse_url_list


@pytest.mark.parametrize(("text", "url"), [
    ("10.0.0.1:9101", "http://10.0.0.1:9101/metrics"),
    (" node1.example:9200 ", "http://node1.example:9200/metrics"),
    ("http://node1:9200", "http://node1:9200/metrics"),
    ("http://node1:9200/", "http://node1:9200/metrics"),
    ("https://node1/custom/path", "https://node1:443/custom/path"),
    ("http://node1", "http://node1:80/metrics"),
    ("http://node1:9200/metrics?collect=x", "http://node1:9200/metrics?collect=x"),
    ("[::1]:9200", "http://[::1]:9200/metrics"),
    ("http://[fe80::1]:9101/m", "http://[fe80::1]:9101/m"),
])
def test_the_forms_it_takes(text: str, url: str) -> None:
    assert parse_url(text).url == url


def test_an_ipv6_endpoint_keeps_its_address_without_brackets() -> None:
    endpoint = parse_url("http://[2001:db8::5]:9200")
    assert (endpoint.host, endpoint.port, endpoint.host_port) == ("2001:db8::5", 9200, "[2001:db8::5]:9200")


def test_a_bare_host_takes_the_callers_default_port() -> None:
    assert parse_url("node7", default_port=DAEMON_PORT) == Endpoint("http", "node7", DAEMON_PORT, "/metrics")
    assert parse_url("http://node7:1", default_path="").path == ""


def test_credentials_become_a_header_and_never_part_of_the_shown_url() -> None:
    endpoint = parse_url("https://user%40x:p%3Ass@hook.example:9200")
    assert endpoint.url == "https://hook.example:9200/metrics" and endpoint.tls
    assert endpoint.authorization == "Basic " + base64.b64encode(b"user@x:p:ss").decode()


@pytest.mark.parametrize(("text", "says"), [
    ("", "an empty URL"),
    ("::1:9200", "an IPv6 address needs brackets"),
    ("fe80::1", "an IPv6 address needs brackets"),
    ("ftp://x:1", "is not a metrics URL"),
    ("node1:99999", "has no valid host and port"),
    ("node1:http", "has no valid host and port"),
    ("node1:0", "port 0"),
    ("http://", "is not a metrics URL"),
    ("bad host:80", "is not a metrics URL"),
    ("node1", "has no port"),
    ("[::1", "has no valid host and port"),
    ("http://[zz::1]:80", "has no valid host and port"),
])
def test_bad_input_is_one_line_saying_what_is_expected(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_url(text, "--hooks")
    message = str(caught.value)
    assert message.startswith("--hooks: ") and says in message and "\n" not in message


def test_a_list_skips_empty_items_and_names_none_as_an_error() -> None:
    assert [e.url for e in parse_url_list("a:1,, b:2")] == ["http://a:1/metrics", "http://b:2/metrics"]
    with pytest.raises(ConfigError, match="names no URL"):
        parse_url_list(" , ")


def test_without_a_where_the_message_starts_with_the_input() -> None:
    """argparse names the flag itself (`argument --daemon: ...`): the reader's line does not name it again."""
    with pytest.raises(ConfigError, match=r"^'ftp://x:1' is not a metrics URL; expected HOST:PORT"):
        parse_url("ftp://x:1", "")


def test_an_engines_base_url_has_no_path_query_or_credentials() -> None:
    """The guard's --upstream: the guard adds the engine's paths and sends the client's own headers."""
    assert [parse_base_url(t).url for t in ("http://vm:8000/", "vm:8000", "https://[::1]")] == [
        "http://vm:8000", "http://vm:8000", "https://[::1]:443"]
    for text, says in (("http://vm:8000/v1", "has the path '/v1'"), ("http://vm:8000?x=1", "has the path '?x=1'"),
                       ("http://u:pw@vm:8000", "'http://vm:8000' is not a base URL (it has credentials)"),
                       ("ftp://vm", "is not a base URL; expected the engine's base URL")):
        with pytest.raises(ConfigError, match=r"^--upstream: ") as caught:
            parse_base_url(text, "--upstream")
        assert says in str(caught.value) and "pw" not in str(caught.value), caught.value
