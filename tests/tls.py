"""A self-signed certificate for the tests' local TLS servers (webhook receivers, image servers)."""

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed_certificate(folder: Path, common_name: str, subject_alt_names: str) -> tuple[Path, Path]:
    """(certificate, key) PEM files in `folder`, valid a day, made with the openssl binary (skips without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make a certificate")
    certificate, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={common_name}",
         "-addext", f"subjectAltName={subject_alt_names}", "-keyout", str(key), "-out", str(certificate)],
        check=True,
        capture_output=True,
    )
    return certificate, key
