"""The web config file: exporter-toolkit's own test data loads (or is refused) as it is there,
and every bad input is one line naming the problem."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from exporter.webconfig.file import (
    GO_CIPHERS,
    WebConfigError,
    load_served,
    load_web_config,
    san_allowed,
    tls_context,
)
from tests.conftest import REPO_ROOT
from tests.support.pki import Authority, web_config

TOOLKIT = REPO_ROOT / "tests" / "data" / "exporter_toolkit"

# exporter-toolkit's outcome for each of its files (tls_config_test.go), as a fragment of our
# message where it refuses the file at start; None where it serves.
AS_IN_TOOLKIT = {
    "web_config_empty.yml": None,
    "web_config_junk.yml": "expected a map",
    "web_config_junk_key.yml": "unknown key 'cert_filse'",
    "web_config_noAuth_certPath_empty.bad.yml": "missing one of cert or cert_file",
    "web_config_noAuth_cert_empty.bad.yml": "missing one of cert or cert_file",
    "web_config_noAuth_keyPath_empty.bad.yml": "missing one of key or key_file",
    "web_config_noAuth_key_empty.bad.yml": "missing one of key or key_file",
    "web_config_noAuth_certPath_keyPath_empty.bad.yml": "missing one of cert or cert_file",
    "web_config_noAuth_certPath_invalid.bad.yml": "no such file",
    "web_config_noAuth_keyPath_invalid.bad.yml": "no such file",
    "web_config_noAuth_certPath_keyPath_invalid.bad.yml": "no such file",
    "web_config_noAuth.bad.yml": "client CA's have been configured without a Client Auth Policy",
    "web_config_auth_clientCAs_invalid.bad.yml": "client CA's have been configured without",
    "web_config_auth_user_list_invalid.bad.yml": "user 'john' is not a bcrypt hash",
    "web_config_noAuth_inventedCiphers.bad.yml": "unknown cipher",
    "web_config_noAuth_inventedCurves.bad.yml": "unknown curve: CurveP257",
    "web_config_noAuth_wrongTLSVersion.bad.yml": "unknown TLS version: TLS111",
    "web_config_noAuth.good.yml": None,
    "web_config_noAuth_tlsInline.good.yml": None,
    "web_config_noAuth_allCiphers.good.yml": None,
    "web_config_noAuth_someCiphers.good.yml": None,
    "web_config_noAuth_someCiphers_noOrder.good.yml": None,
    "web_config_noAuth_someCurves.good.yml": None,
    "web_config_noAuth_noHTTP2.good.yml": None,
    "web_config_headers.good.yml": None,
    "web_config_headers_content_type_options.bad.yml": "invalid value for X-Content-Type-Options",
    "web_config_headers_frame_options.bad.yml": "invalid value for X-Frame-Options",
    "web_config_headers_extra_header.bad.yml": 'HTTP header "Content-Type" can not be configured',
    "tls_config_noAuth.requireandverifyclientcert.good.yml": None,
    "web_config_auth_client_san.good.yaml": None,
    # Refused at the handshake there (a SAN not allowed), served here: the SAN check is per
    # connection (tests/http/test_tls.py).
    "web_config_auth_client_san.bad.yaml": None,
    "web_config_rate_limiter_nonblocking.yaml": None,
    "web_config_rate_limiter_one_second.yaml": None,
    "web_config_users.good.yml": None,
    "web_config_users_noTLS.good.yml": None,
    # Served, with client certificates verified against the system's CAs, as Go does; its
    # tests' self-signed clients are refused at the handshake there and here.
    "web_config_noAuth.good.blocking.yml": None,
    "web_config_auth_clientCAs_missing.bad.yml": None,
    "docs-web-config.yml": None,  # beside exporter-toolkit's test server.crt here
}
# Where this implementation differs from exporter-toolkit, and why (docs/deploy.md).
DIFFERENT = {
    # Python's ssl cannot ask for a client certificate without verifying it.
    "tls_config_noAuth.requireanyclientcert.good.yml": "RequireAnyClientCert is not supported",
    "tls_config_noAuth.requireanyclientcertkeyinline.good.yml": "is not supported",
    # Go refuses HTTP/2 without its mandatory cipher; this server speaks HTTP/1.1 only.
    "web_config_noAuth_noHTTP2Cipher.bad.yml": None,
    # One curve only on a Python without SSLContext.set_groups.
    "web_config_noAuth_allCurves.good.yml": "sets one curve only",
}


def _outcome(path: Path) -> str | None:
    try:
        load_served(path)
    except WebConfigError as exc:
        message = str(exc)
        assert "\n" not in message and str(path) in message
        return message
    return None


def test_every_file_of_exporter_toolkits_test_data_is_listed():
    files = {p.name for p in TOOLKIT.iterdir() if p.suffix in (".yml", ".yaml")}
    assert files == set(AS_IN_TOOLKIT) | set(DIFFERENT)


@pytest.mark.parametrize("name", sorted({**AS_IN_TOOLKIT, **DIFFERENT}))
def test_exporter_toolkits_files_load_as_there(name):
    expected = {**AS_IN_TOOLKIT, **DIFFERENT}[name]
    if name == "web_config_noAuth_allCurves.good.yml" and hasattr(
        __import__("ssl").SSLContext, "set_groups"
    ):
        expected = None
    got = _outcome(TOOLKIT / name)
    if expected is None:
        assert got is None, got
    else:
        assert got is not None and expected.lower() in got.lower(), got


def test_the_documentations_example_loads_beside_its_certificate(tmp_path):
    for name in ("docs-web-config.yml", "server.crt", "server.key"):
        shutil.copy(TOOLKIT / name, tmp_path / name)
    os.chmod(tmp_path / "server.key", 0o600)
    config = load_web_config(tmp_path / "docs-web-config.yml")
    assert config.tls is not None and config.tls.cert_file == str(tmp_path / "server.crt")
    assert set(config.users) == {"alice", "bob"}
    assert (config.rate_interval_s, config.rate_burst) == (1.0, 20)
    tls_context(config.tls)


def test_inline_certificate_and_key_are_served_like_files(tmp_path):
    config = load_web_config(TOOLKIT / "web_config_noAuth_tlsInline.good.yml")
    assert config.tls is not None and config.tls.cert and not config.tls.cert_file
    assert tls_context(config.tls).verify_mode.name == "CERT_OPTIONAL"  # VerifyClientCertIfGiven


def test_the_cipher_table_names_what_openssl_calls_them():
    """GO_CIPHERS maps Go's (IANA) names to OpenSSL's: held to `openssl ciphers -stdname`."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found")
    listing = subprocess.run(
        [openssl, "ciphers", "-stdname", "ALL"], capture_output=True, text=True, check=True
    ).stdout
    standard = {line.split()[0]: line.split()[2] for line in listing.splitlines() if " - " in line}
    for go_name, openssl_name in GO_CIPHERS.items():
        assert standard.get(go_name) == openssl_name, go_name


@pytest.fixture
def pki(tmp_path):
    ca = Authority(tmp_path / "pki")
    return ca, ca.issue("server")


def _tls_file(tmp_path, pki, extra: str = "", **paths: str) -> Path:
    _ca, server = pki
    cert = paths.get("cert", str(server.cert))
    key = paths.get("key", str(server.key))
    return web_config(
        tmp_path, f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n{extra}"
    )


def test_relative_file_names_are_relative_to_the_files_folder(tmp_path, pki):
    _, server = pki
    shutil.copy(server.cert, tmp_path / "s.crt")
    shutil.copy(server.key, tmp_path / "s.key")
    path = _tls_file(tmp_path, pki, cert="s.crt", key="s.key")
    config = load_web_config(path)
    assert config.tls is not None and config.tls.key_file == str(tmp_path / "s.key")


@pytest.mark.parametrize(
    ("problem", "expected"),
    [
        ("expired", "the certificate expired at 2020-01-02"),
        ("mismatch", "failed to load the certificate and key"),
        ("not_pem", "failed to load the certificate and key"),
        ("directory", "is a directory"),
        ("dangling", "no such file"),
        ("writable_key", "may be written by other users"),
        ("bad_client_ca", "client CA"),
        ("unknown_key", "unknown key 'cert_flie' in tls_server_config"),
        ("min_above_max", "min_version is above max_version"),
        ("header_newline", "invalid value for Content-Security-Policy"),
        ("rate", "rate_limit.interval: expected a duration"),
    ],
)
def test_bad_input_is_one_line_naming_it(tmp_path, pki, problem, expected):
    ca, server = pki
    extra = ""
    paths: dict[str, str] = {}
    if problem == "expired":
        old = ca.issue("old", expired=True)
        paths = {"cert": str(old.cert), "key": str(old.key)}
    elif problem == "mismatch":
        paths = {"key": str(ca.issue("other").key)}
    elif problem == "not_pem":
        (tmp_path / "junk.crt").write_text("not a certificate\n")
        paths = {"cert": str(tmp_path / "junk.crt")}
    elif problem == "directory":
        (tmp_path / "dir.crt").mkdir()
        paths = {"cert": str(tmp_path / "dir.crt")}
    elif problem == "dangling":
        (tmp_path / "gone.crt").symlink_to(tmp_path / "nowhere")
        paths = {"cert": str(tmp_path / "gone.crt")}
    elif problem == "writable_key":
        os.chmod(server.key, 0o666)
    elif problem == "bad_client_ca":
        (tmp_path / "ca.pem").write_text(
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
        )
        ca_file = tmp_path / "ca.pem"
        extra = f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {ca_file}\n"
    elif problem == "unknown_key":
        extra = "  cert_flie: x\n"
    elif problem == "min_above_max":
        extra = "  min_version: TLS13\n  max_version: TLS12\n"
    elif problem == "header_newline":
        extra = (
            'http_server_config:\n  headers:\n    Content-Security-Policy: "a\\r\\nSet-Cookie: x"\n'
        )
    elif problem == "rate":
        extra = "rate_limit:\n  interval: soon\n"
    message = _outcome(_tls_file(tmp_path, pki, extra, **paths))
    assert message is not None and expected in message, message


def test_a_web_config_that_is_a_directory_or_missing_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(WebConfigError, match="is a directory"):
        load_web_config(tmp_path / "d")
    with pytest.raises(WebConfigError, match="No such file"):
        load_web_config(tmp_path / "missing.yml")


def test_a_bcrypt_hash_is_never_echoed(tmp_path):
    path = web_config(tmp_path, "basic_auth_users:\n  alice: hunter2-plain-password\n")
    with pytest.raises(WebConfigError) as caught:
        load_web_config(path)
    assert "hunter2" not in str(caught.value)


def test_client_allowed_sans_match_dns_ip_email_and_uri_exactly():
    cert = {
        "subjectAltName": (
            ("DNS", "prometheus.monitoring.svc"),
            ("IP Address", "2001:DB8:0:0:0:0:0:1\n"),
            ("email", "oncall@example.com"),
            ("URI", "spiffe://cluster/ns/monitoring/sa/prometheus"),
        )
    }
    assert san_allowed(cert, ("prometheus.monitoring.svc",))
    assert san_allowed(cert, ("2001:db8::1",))  # Go's form of OpenSSL's
    assert san_allowed(cert, ("oncall@example.com",))
    assert san_allowed(cert, ("spiffe://cluster/ns/monitoring/sa/prometheus",))
    assert not san_allowed(cert, ("prometheus",))  # exact, not a prefix or a CN
    assert not san_allowed({}, ("prometheus.monitoring.svc",))


def test_a_huge_or_endless_web_config_is_refused_at_once_the_last_good_one_kept(tmp_path):
    """Round 4, LOW 13: the file is parsed on the event loop when it changes: 10 MB of YAML
    stalled every request, /healthz included, for ~4 s. Past 128 KiB it is refused unread;
    a FIFO in its place is refused without a wait."""
    import os
    import time

    from exporter.webconfig.file import WebConfigError, load_web_config
    from exporter.webconfig.security import WebSecurity
    from tests.support.pki import web_config

    header = "    X-Frame-Options: deny\n"
    path = web_config(tmp_path, "http_server_config:\n  headers:\n" + header)
    web = WebSecurity(str(path))
    web_config(tmp_path, "http_server_config:\n  headers:\n" + header * 500_000)  # 13 MB
    started = time.monotonic()
    web.refresh(now=True)
    assert time.monotonic() - started < 0.5
    assert not web.reload_ok and "larger than 128 KiB" in web.last_error
    assert web.headers == {"X-Frame-Options": "deny"}  # the last good one serves on
    fifo = tmp_path / "fifo.yml"
    os.mkfifo(fifo)
    with pytest.raises(WebConfigError, match="not a regular file"):
        load_web_config(fifo)


def test_a_flood_of_wrong_passwords_never_pushes_out_the_right_one():
    """Issue 64 (MED): wrong results shared one cache with right ones and a random tenth was
    evicted when it was full, so Prometheus's password fell out under a flood of never-seen
    wrong ones, and its next check queued behind theirs (17 of 105 scrapes lost to 503). The
    right one checked out stays known (answered without a bcrypt check) whatever the flood."""
    import base64

    import bcrypt

    from exporter.webconfig.basic_auth import CACHE_SIZE, BasicAuth

    def header(password: str) -> str:
        return "Basic " + base64.b64encode(f"prometheus:{password}".encode()).decode()

    users = {"prometheus": bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()}
    auth = BasicAuth()
    assert auth.check(users, header("s3cret")) is True
    for guess in range(10 * CACHE_SIZE):
        assert auth.check(users, header(f"wrong-{guess}")) is False
        # Known good: answered on the event loop, never waiting for a place to be checked.
        assert auth.check(users, header("s3cret"), may_block=False) is True
    assert auth.check(users, header("wrong-0"), may_block=False) in (False, None)  # bounded
