"""telemetry/url.py: memtel's one URL parser (ledger, top, flight, guard, the ladder's config), and the check that
no other module of telemetry/, harness/ or benchmarks/ splits a URL itself."""

from __future__ import annotations

import ast
import base64
from pathlib import Path

import pytest

from telemetry.errors import ConfigError
from telemetry.scrape import DAEMON_PORT
from telemetry.url import Endpoint, parse_base_url, parse_http_url, parse_url, parse_url_list, redact_credentials


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
    assert "p%3Ass" not in repr(endpoint) and endpoint.userinfo == "user%40x:p%3Ass"
    assert endpoint.base_with_credentials == "https://user%40x:p%3Ass@hook.example:9200"   # for httpx, never shown
    with pytest.raises(ConfigError) as caught:
        parse_url("http://scraper:Secret-9@bad host:80", "--hooks")
    assert "Secret-9" not in str(caught.value) and "'http://***@bad host:80'" in str(caught.value)


def test_a_config_files_url_names_its_scheme_and_keeps_its_path() -> None:
    """A ladder's URLs (telemetry/validate.py `Validator.url`): `http(s)://` written out, the path as written."""
    assert parse_http_url("http://127.0.0.1:8000/health").url == "http://127.0.0.1:8000/health"
    assert parse_http_url("https://vm").url == "https://vm:443"
    for text, says in (("spark-a:9101", "expected an http(s) URL such as http://127.0.0.1:8000, got 'spark-a:9101', "
                                        "which has no scheme"),
                       ("ftp://vm:1", "which is not an http(s) URL"),
                       ("http://[::1:80", "which has no valid host and port"),
                       ("http://bad_host:1/x", "which has no valid host (a host name or an IP address)"),
                       ("http://u:Pw-1@vm:0", "got 'http://***@vm:0', which has port 0; expected a port from 1 to")):
        with pytest.raises(ConfigError, match=r"^nodes\.a: ") as caught:
            parse_http_url(text, "nodes.a")
        assert says in str(caught.value), caught.value


def test_credentials_are_redacted_wherever_text_quotes_a_url() -> None:
    assert redact_credentials("GET http://u:pw@h:1/x and https://tok@h2 failed; ftp://h3") == (
        "GET http://***@h:1/x and https://***@h2 failed; ftp://h3")


@pytest.mark.parametrize(("text", "says"), [
    ("", "is an empty URL"),
    ("::1:9200", "an IPv6 address without brackets; expected e.g. [::1]"),
    ("fe80::1", "an IPv6 address without brackets"),
    ("ftp://x:1", "is not a metrics URL"),
    ("node1:99999", "has no valid host and port"),
    ("node1:http", "has no valid host and port"),
    ("node1:0", "has port 0; expected a port from 1 to 65535"),
    ("http://", "has no valid host (a host name or an IP address)"),
    ("bad host:80", "has no valid host (a host name or an IP address)"),
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


# -- no other parser ------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
_BUILDERS = {"urlencode", "quote", "quote_plus"}   # urllib.parse's functions that build a query, not parse a URL
_ELSEWHERE = "memtel has one URL parser: telemetry/url.py (parse_url, parse_base_url, parse_http_url, Endpoint)"


def _position(node: ast.AST) -> tuple[int, int]:
    return getattr(node, "lineno", 0), getattr(node, "col_offset", 0)


def _url_parsing(roots: tuple[Path, ...]) -> list[str]:
    """`file:line what` for each use of a URL parser (urllib.parse's, httpx.URL, urllib3's) outside telemetry/url.py."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path == ROOT / "telemetry" / "url.py":
                continue
            text = path.read_text()
            if "urllib" not in text and "httpx.URL" not in text:   # most files reach no parser: not parsed
                continue
            for node in sorted(ast.walk(ast.parse(text)), key=_position):
                what = None
                if isinstance(node, ast.ImportFrom) and node.module in ("urllib.parse", "urllib3.util", "urllib3"):
                    names = [a.name for a in node.names if a.name not in _BUILDERS]
                    what = f"imports {', '.join(names)} from {node.module}" if names else None
                elif isinstance(node, ast.ImportFrom) and node.module == "urllib" and any(
                        a.name == "parse" for a in node.names):
                    what = "imports urllib.parse as parse"
                elif isinstance(node, ast.Attribute) and node.attr not in _BUILDERS and ast.unparse(node.value) in (
                        "urllib.parse", "urllib3.util"):
                    what = f"calls {ast.unparse(node)}"
                elif isinstance(node, ast.Attribute) and ast.unparse(node) == "httpx.URL":
                    what = "parses with httpx.URL"
                if what:
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    found.append(f"{where}:{_position(node)[0]} {what}")
    return found


def test_no_other_module_parses_a_url() -> None:
    found = _url_parsing((ROOT / "telemetry", ROOT / "harness", ROOT / "benchmarks"))
    assert not found, f"{_ELSEWHERE}; these parse URLs themselves:\n" + "\n".join(found)


def test_a_module_splitting_a_url_itself_is_caught(tmp_path: Path) -> None:
    """The check itself: each way of reaching a parser is caught; building a query string is not parsing."""
    (tmp_path / "client.py").write_text('''import urllib.parse
from urllib.parse import urlsplit, urlencode
from urllib import parse
import httpx
def go(url):
    return urllib.parse.urlparse(url).port, urlsplit(url), httpx.URL(url), urllib.parse.urlencode({"q": 1})
''')
    assert [line.partition(" ")[2] for line in _url_parsing((tmp_path,))] == [
        "imports urlsplit from urllib.parse", "imports urllib.parse as parse", "calls urllib.parse.urlparse",
        "parses with httpx.URL"]
