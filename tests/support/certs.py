"""A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, made with the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_client_cert: Path  # signed by another CA: must be refused
    other_client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=directory)


def _signed(directory: Path, name: str, ca: str, subject: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", subject,
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=directory)


def make_certs(directory: Path) -> Certs:
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is missing: apt-get install -y openssl")
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    _signed(directory, "server", "ca", "/CN=127.0.0.1",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _signed(directory, "client", "ca", "/CN=prometheus", "extendedKeyUsage=clientAuth\n")
    _signed(directory, "other-client", "other-ca", "/CN=intruder", "extendedKeyUsage=clientAuth\n")
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    d = directory
    return Certs(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key",
                 d / "other-client.crt", d / "other-client.key")
