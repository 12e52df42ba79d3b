"""Throwaway TLS certificates for a test's own servers, made with the openssl CLI."""

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificates:
    ca: Path
    cert: Path
    key: Path
    ca_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path, name: str = "server",
                      ca: Certificates | None = None) -> Certificates:
    """A CA (unless `ca` is given) and a certificate it signed for 127.0.0.1 and
    localhost, usable by a server and as a client's; valid for a day."""
    directory.mkdir(parents=True, exist_ok=True)
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    if ca is None:
        _openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
                 "-subj", "/CN=tether-test-ca", cwd=directory)
        ca = Certificates(directory / "ca.pem", directory / "ca.pem", directory / "ca.key",
                          directory / "ca.key")
    _openssl("req", *curve, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=directory)
    (directory / f"{name}.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca.ca), "-CAkey", str(ca.ca_key),
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
             "-extfile", f"{name}.ext", cwd=directory)
    return Certificates(ca.ca, directory / f"{name}.pem", directory / f"{name}.key", ca.ca_key)
