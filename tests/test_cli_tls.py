"""The CLI against an exporter secured by its web config: https with a CA and a client
certificate, basic auth for `record`, the kubeconfig's token, and flags that do not fit."""

from __future__ import annotations

import os

import bcrypt
import pytest
import yaml

from tests.helpers import TOKEN, run_cli, served
from tests.support.pki import Authority, web_config


@pytest.fixture
def secured(tmp_path):
    ca = Authority(tmp_path / "pki")
    server, client = ca.issue("exporter"), ca.issue("oncall", "DNS:oncall")
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()
    path = web_config(
        tmp_path,
        f"tls_server_config:\n  cert_file: {server.cert}\n  key_file: {server.key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {ca.cert}\n"
        f"basic_auth_users:\n  prometheus: {hashed}\n",
    )
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "password").write_text("pw\n")
    with served(tmp_path, web_config_file=str(path)) as (exporter, _):
        url = f"https://localhost:{exporter.port}"
        tls = ["--ca-file", str(ca.cert), "--cert", str(client.cert), "--key", str(client.key)]
        yield url, tls, tmp_path


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}
    return {**env, **more}


@pytest.mark.slow
def test_admin_commands_over_https_with_a_client_certificate(secured):
    url, tls, tmp = secured
    done = run_cli("stats", "--url", url, *tls, "--token-file", str(tmp / "token"), env=_env())
    assert done.returncode == 0, done.stderr
    assert '"mode": "demo"' in done.stdout
    refused = run_cli("stats", "--url", url, "--ca-file", tls[1], "--token-file",
                      str(tmp / "token"), env=_env())  # fmt: skip
    assert refused.returncode == 2
    assert "CERTIFICATE_REQUIRED" in refused.stderr and len(refused.stderr.splitlines()) == 1


@pytest.mark.slow
def test_record_with_basic_auth(secured):
    url, tls, tmp = secured
    out = tmp / "trace.jsonl.gz"
    password = ["--user", "prometheus", "--password-file", str(tmp / "password")]
    done = run_cli("record", "--url", url, *tls, *password, "-o", str(out), "--duration-s", "1",
                   env=_env())  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.exists()
    wrong = run_cli("record", "--url", url, *tls, "--user", "prometheus", "-o",
                    str(tmp / "x.jsonl.gz"), "--duration-s", "1",
                    env=_env(GPUMEM_PASSWORD="nope"))  # fmt: skip
    assert wrong.returncode == 2 and "HTTP 401" in wrong.stderr
    # The server asked for basic auth: the CLI says so, not "an admin token" (issue 54).
    assert "asks for basic auth" in wrong.stderr and "refused" in wrong.stderr, wrong.stderr
    none = run_cli("record", "--url", url, *tls, "-o", str(tmp / "y.jsonl.gz"),
                   "--duration-s", "1", env=_env())  # fmt: skip
    assert none.returncode == 2 and "asks for basic auth: pass --user" in none.stderr
    assert "admin token" not in none.stderr and len(none.stderr.splitlines()) == 1


@pytest.mark.slow
def test_the_kubeconfigs_token_is_sent(secured):
    url, tls, tmp = secured
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "current-context": "oncall",
        "contexts": [{"name": "oncall", "context": {"cluster": "c", "user": "me"}}],
        "users": [{"name": "me", "user": {"token": TOKEN}}],
    }))  # fmt: skip
    done = run_cli("stats", "--url", url, *tls, "--kubeconfig-token",
                   env=_env(KUBECONFIG=str(kubeconfig)))  # fmt: skip
    assert done.returncode == 0, done.stderr
    kubeconfig.write_text(yaml.safe_dump({
        "current-context": "oncall",
        "contexts": [{"name": "oncall", "context": {"cluster": "c", "user": "me"}}],
        "users": [{"name": "me", "user": {"exec": {"command": "aws"}}}],
    }))  # fmt: skip
    failed = run_cli("stats", "--url", url, *tls, "--kubeconfig-token",
                     env=_env(KUBECONFIG=str(kubeconfig)))  # fmt: skip
    assert failed.returncode == 2 and "kubectl create token" in failed.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--url", "https://localhost:1", "--cert", "c.pem"], "--cert and --key go together"),
        (["--url", "http://localhost:1", "--ca-file", "ca.pem"], "need an https:// --url"),
        (["--url", "https://localhost:1", "--user", "u"], "--user needs --password-file"),
        (["--url", "https://localhost:1", "--ca-file", "/nonexistent/ca.pem"], "no such file"),
        (["--url", "http://localhost:1", "--password-file", "p"], "--password-file needs --user"),
    ],
)
def test_transport_flags_that_do_not_fit_are_one_line(flags, expected):
    done = run_cli("stats", *flags, env=_env())
    assert done.returncode == 2
    assert expected in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
