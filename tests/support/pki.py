"""Certificates for TLS tests, made by the real `openssl`: a CA, server and client certificates
signed by it (with the SANs asked for), self-signed ones, and expired ones."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


def _openssl() -> str:
    tool = shutil.which("openssl")
    if tool is None:
        pytest.skip("openssl not found")
    return tool


def _run(*args: str) -> None:
    subprocess.run([_openssl(), *args], check=True, capture_output=True)


@dataclass
class Pair:
    cert: Path
    key: Path


class Authority:
    """A CA in `folder` that signs certificates."""

    def __init__(self, folder: Path, name: str = "ca") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.cert, self.key = folder / f"{name}.crt", folder / f"{name}.key"
        _run(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-days", "30", "-subj", f"/CN={name}", "-keyout", str(self.key), "-out", str(self.cert),
        )  # fmt: skip
        os.chmod(self.key, 0o600)

    def issue(
        self, name: str, sans: str = "DNS:localhost,IP:127.0.0.1", *, days: int = 30,
        rsa: bool = False, expired: bool = False
    ) -> Pair:  # fmt: skip
        """A certificate for `name` with these SANs (openssl's subjectAltName syntax)."""
        cert, key = self.folder / f"{name}.crt", self.folder / f"{name}.key"
        csr = self.folder / f"{name}.csr"
        algorithm = ["rsa:2048"] if rsa else ["ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
        _run(
            "req", "-newkey", *algorithm, "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(key), "-out", str(csr),
        )  # fmt: skip
        extensions = self.folder / f"{name}.ext"
        extensions.write_text(f"subjectAltName={sans}\n")
        if expired:
            self._expired(csr, cert, extensions)
        else:
            _run(
                "x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
                "-CAcreateserial", "-out", str(cert), "-extfile", str(extensions),
                "-days", str(days),
            )  # fmt: skip
        os.chmod(key, 0o600)
        return Pair(cert, key)

    def _expired(self, csr: Path, cert: Path, extensions: Path) -> None:
        """Valid for a day in 2020 (`openssl x509` of OpenSSL 3.0 cannot backdate; `ca` can)."""
        db = self.folder / "db"
        db.mkdir(exist_ok=True)
        (db / "index.txt").write_text("")
        (db / "serial").write_text("01\n")
        config = db / "ca.cnf"
        config.write_text(
            f"[ca]\ndefault_ca = d\n[d]\ndatabase = {db}/index.txt\nnew_certs_dir = {db}\n"
            f"serial = {db}/serial\ndefault_md = sha256\npolicy = p\nunique_subject = no\n"
            "[p]\ncommonName = supplied\n"
        )
        _run(
            "ca", "-batch", "-config", str(config), "-cert", str(self.cert),
            "-keyfile", str(self.key), "-in", str(csr), "-out", str(cert), "-notext",
            "-extfile", str(extensions),
            "-startdate", "20200101000000Z", "-enddate", "20200102000000Z",
        )  # fmt: skip


def web_config(folder: Path, text: str, name: str = "web.yml") -> Path:
    """Write a web config (written whole, then renamed: a reader never sees half of it)."""
    path = folder / name
    partial = folder / f".{name}.tmp"
    partial.write_text(text)
    partial.replace(path)
    return path
