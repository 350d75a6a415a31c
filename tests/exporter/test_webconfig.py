"""TLS and basic auth through the exporter toolkit's web config file, on the real daemon, with real curl.

Certificates are made at test time with the openssl CLI (tests/support/certs.py); the bcrypt hash
with the bcrypt package, as `htpasswd -nBC 10` would make it.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.request

import pytest
import yaml

from tests.daemon.helpers import Daemon, check_config, run_cli
from tests.support.certs import Certs, make_certs
from tests.support.extras import need

PASSWORD = "s3cret-for-the-test"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def curl(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("curl") is None:
        pytest.fail("curl is missing: apt-get install -y curl")
    return subprocess.run(["curl", "-sS", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code}", *args],
                          capture_output=True, text=True, timeout=30)


def web_config(tmp_path, data: dict) -> str:
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def daemon(tmp_path, config: str, certs: Certs, **options) -> Daemon:
    (tmp_path / "kern.log").touch()
    return Daemon(tmp_path / "state", "--kmsg", str(tmp_path / "kern.log"), "--disable-collector", "nvml",
                  "--web-config", config, tls_ca=certs.ca, **options)


def test_tls_and_basic_auth_with_curl(tmp_path, certs):
    bcrypt = need("bcrypt")  # the `auth` extra: skips with that reason where it is missing
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    config = web_config(tmp_path, {
        "tls_server_config": {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
        "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}},
        "basic_auth_users": {"prometheus": hashed.replace("$2b$", "$2y$")},  # htpasswd writes $2y$
    })
    with daemon(tmp_path, config, certs, auth=("prometheus", PASSWORD)) as running:
        url = f"https://127.0.0.1:{running.port}/metrics"
        assert curl("--cacert", str(certs.ca), "-u", f"prometheus:{PASSWORD}", url).stdout == "200"
        assert curl("--cacert", str(certs.ca), "-u", "prometheus:wrong", url).stdout == "401"
        assert curl("--cacert", str(certs.ca), "-u", f"nobody:{PASSWORD}", url).stdout == "401"
        assert curl("--cacert", str(certs.ca), url).stdout == "401"
        plain = curl(f"http://127.0.0.1:{running.port}/metrics")  # plain HTTP to a TLS port
        assert plain.stdout in ("000", "400") and plain.stdout != "200"
        untrusted = curl(url)  # the server's CA is not in the system store
        assert untrusted.returncode != 0
        # Python's ssl client too, with the header set by the web config
        context = ssl.create_default_context(cafile=str(certs.ca))
        request = urllib.request.Request(url, headers={"Authorization": "Basic " + _basic("prometheus", PASSWORD)})
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            assert response.status == 200 and response.headers["X-Content-Type-Options"] == "nosniff"
            assert b"memtel_collector_success" in response.read()
        scrape = curl("--cacert", str(certs.ca), "-u", f"prometheus:{PASSWORD}", url.replace("/metrics", "/healthz"))
        assert scrape.stdout == "200"
    assert "TLS, basic auth (1 users)" in running.log()


def _basic(user: str, password: str) -> str:
    import base64

    return base64.b64encode(f"{user}:{password}".encode()).decode()


def test_client_certificates_required(tmp_path, certs):
    config = web_config(tmp_path, {"tls_server_config": {
        "cert_file": str(certs.server_cert), "key_file": str(certs.server_key),
        "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": str(certs.ca)}})
    with daemon(tmp_path, config, certs, client_cert=(certs.client_cert, certs.client_key)) as running:
        url = f"https://127.0.0.1:{running.port}/metrics"
        ok = curl("--cacert", str(certs.ca), "--cert", str(certs.client_cert), "--key", str(certs.client_key), url)
        assert ok.stdout == "200"
        assert curl("--cacert", str(certs.ca), url).stdout != "200"  # no client certificate
        other = curl("--cacert", str(certs.ca), "--cert", str(certs.other_client_cert),
                     "--key", str(certs.other_client_key), url)
        assert other.stdout != "200"  # signed by a CA the server does not trust
        assert curl("--cacert", str(certs.ca), "--cert", str(certs.client_cert), "--key", str(certs.client_key),
                    url).stdout == "200"  # failed handshakes did not hurt the server
    assert "client certificates required" in running.log()


def test_relative_paths_are_relative_to_the_web_config_file(tmp_path, certs):
    shutil.copy(certs.server_cert, tmp_path / "server.crt")
    shutil.copy(certs.server_key, tmp_path / "server.key")
    config = web_config(tmp_path, {"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key"}})
    result = check_config("--web-config", config)
    assert result.returncode == 0 and "TLS" in result.stdout, result.stderr


def _bad_configs(tmp_path, certs) -> list[tuple[str, str]]:
    """(web config text, what the one line must say)."""
    key, cert, ca = certs.server_key, certs.server_cert, certs.ca
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(key), "-aes256", "-passout", "pass:x", "-out", str(encrypted)],
                   check=True, capture_output=True)
    return [
        ("tls_server_config: [\n", "not valid YAML"),
        ("tls_server_config:\n  cert_file: /nonexistent.crt\n  key_file: /nonexistent.key\n", "is not a readable file"),
        (f"tls_server_config:\n  key_file: {key}\n", "missing cert_file"),
        (f"tls_server_config:\n  cert_file: {cert}\n", "missing key_file"),
        (f"tls_server_config:\n  cert_file: {key}\n  key_file: {key}\n", "cannot load the certificate"),
        (f"tls_server_config:\n  cert_file: {cert}\n  key_file: {encrypted}\n", "is encrypted"),
        (f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_ca_file: {ca}\n",
         "client_ca_file is set without a client_auth_type"),
        (f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
         "  client_auth_type: RequireAndVerifyClientCert\n", "needs client_ca_file"),
        (f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_auth_type: RequireAnyClientCert\n",
         "not supported"),
        (f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  min_version: TLS14\n", "unknown TLS version"),
        (f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  min_version: TLS13\n  max_version: TLS12\n",
         "min_version is above max_version"),
        (f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
         "cipher_suites: not supported"),
        ("basic_auth_users:\n  prometheus: plain-password\n", "expected a bcrypt hash"),
        ("basic_auth_users: [a, b]\n", "expected a mapping of user names"),
        ("basic_auth_user:\n  prometheus: x\n", "unknown key 'basic_auth_user'"),
        ("rate_limit:\n  interval: 1s\n", "rate_limit: not supported"),
        ("http_server_config:\n  headers:\n    Content-Type: text/html\n", "set by the exporter itself"),
        ("http_server_config:\n  headers:\n    X-Bad: \"a\\nb\"\n", "printable ASCII"),
        ("a: &x [1]\nb: *x\n", "aliases"),
        ("- just\n- a list\n", "expected a mapping"),
    ]


@pytest.mark.slow
def test_a_bad_web_config_is_one_line_and_exit_2(tmp_path, certs):
    """Each bad config twice: with --check-config in this process (`check_config`), and starting the real
    daemon (a subprocess), which must refuse it before making its state directory."""
    failures = []
    for i, (text, expected) in enumerate(_bad_configs(tmp_path, certs)):
        path = tmp_path / f"bad-{i}.yml"
        path.write_text(text)
        for extra in (("--check-config",), ("--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / f"s{i}"))):
            if extra == ("--check-config",):
                result = check_config("--web-config", str(path))
            else:
                result = run_cli("--web-config", str(path), *extra)
            lines = result.stderr.strip().splitlines()
            if (result.returncode != 2 or len(lines) != 1 or expected not in lines[0]
                    or "Traceback" in result.stderr or (tmp_path / f"s{i}").exists()):
                failures.append((text, extra[0], result.returncode, result.stderr))
    missing = run_cli("--web-config", str(tmp_path / "missing.yml"), "--check-config")
    assert missing.returncode == 2 and "cannot read web config file" in missing.stderr
    assert failures == []


def test_extra_headers_are_ones_h11_can_send(tmp_path):
    """h11 frames every answer: a header it refuses (spaces around a value) would fail every response, and one that
    frames the body (Transfer-Encoding) would replace the exporter's Content-Length. Found switching to h11."""
    from telemetry.errors import ConfigError
    from telemetry.exporter.protocol import frame_response, new_connection, next_request
    from telemetry.exporter.webconfig import web_config_from_mapping

    config = web_config_from_mapping({"http_server_config": {"headers": {"X-Frame-Options": " deny "}}}, "web.yml",
                                     tmp_path)
    assert config.headers == (("X-Frame-Options", "deny"),)
    http = new_connection(1024)
    http.receive_data(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert next_request(http) is not None
    assert b"\r\nX-Frame-Options: deny\r\n" in frame_response(http, 200, b"ok", "text/plain",
                                                               extra_headers=config.headers)
    with pytest.raises(ConfigError, match="Transfer-Encoding: this header is set by the exporter itself"):
        web_config_from_mapping({"http_server_config": {"headers": {"Transfer-Encoding": "chunked"}}}, "web.yml",
                                tmp_path)
