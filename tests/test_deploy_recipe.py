"""docs/deploy.md's recipe for certificates and a password, run as written: what it makes is
what an exporter requiring client certificates and basic auth serves with, and a client with
Prometheus's certificate and password is answered (one without either is not)."""

from __future__ import annotations

import base64
import http.client
import os
import re
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, require_tool
from tests.helpers import served
from tests.support.pki import web_config

DEPLOY = REPO_ROOT / "docs" / "deploy.md"
PASSWORD = "scrape-password"


def recipe() -> str:
    """The sh block under "Certificates and a password for it"."""
    text = DEPLOY.read_text()
    section = text[text.index("#### Certificates and a password for it") :]
    found = re.search(r"```sh\n(.*?)```", section, re.S)
    assert found, "no sh block in the recipe's section"
    return found.group(1)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tool("openssl")
    folder = tmp_path_factory.mktemp("recipe")
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "gpumem-exporter").exists(), "the console script beside this python"
    env = dict(
        os.environ, SCRAPE_PASSWORD=PASSWORD, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    )
    subprocess.run(["sh", "-e", "-c", recipe()], cwd=folder, env=env, check=True, timeout=120)
    return folder


def ask(port: int, folder: Path, *, cert: bool, password: str | None) -> int:
    context = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    if cert:
        context.load_cert_chain(folder / "client.crt", folder / "client.key")
    connection = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
    headers = {}
    if password is not None:
        secret = base64.b64encode(f"prometheus:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {secret}"
    try:
        connection.request("GET", "/metrics", headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_recipes_certificates_and_hash_serve_prometheus_and_refuse_others(made, tmp_path):
    hashed = (made / "prometheus.hash").read_text().strip()
    assert hashed.startswith("$2b$10$")
    config = web_config(
        tmp_path,
        f"tls_server_config:\n  cert_file: {made / 'tls.crt'}\n  key_file: {made / 'tls.key'}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {made / 'ca.crt'}\n"
        "  client_allowed_sans: [prometheus]\n"
        f"basic_auth_users:\n  prometheus: {hashed}\n",
    )
    with served(tmp_path, web_config_file=str(config)) as (server, _):
        assert ask(server.port, made, cert=True, password=PASSWORD) == 200
        assert ask(server.port, made, cert=True, password="wrong") == 401
        with pytest.raises((ssl.SSLError, ConnectionError)):
            ask(server.port, made, cert=False, password=PASSWORD)
    # The client certificate says what it is for; the server's names the hosts.
    client = subprocess.run(
        ["openssl", "x509", "-in", made / "client.crt", "-noout", "-ext", "extendedKeyUsage"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "TLS Web Client Authentication" in client


@pytest.mark.parametrize(
    ("stdin", "args", "message"),
    [
        ("\n", [], "an empty password"),
        ("x" * 73 + "\n", [], "more than 72 bytes"),
        ("pw\n", ["--cost", "4"], "--cost: expected 10 to 16"),
    ],
)
def test_hash_password_refuses_what_would_not_protect(stdin: str, args: list[str], message: str):
    done = subprocess.run(
        [sys.executable, "-m", "exporter.cli", "hash-password", *args],
        input=stdin, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"gpumem-exporter hash-password: error: {message}" or (
        message in done.stderr and done.stderr.count("\n") == 1
    )
