"""The web configuration file of Prometheus exporters (exporter-toolkit's format), read here.

node_exporter, dcgm-exporter and most Go exporters take `--web.config.file`: TLS
(`tls_server_config`), response headers (`http_server_config.headers`), bcrypt basic auth
(`basic_auth_users`) and a request rate limit (`rate_limit`). This module reads the same file
with the same keys, defaults and checks (docs/web-configuration.md of exporter-toolkit): an
unknown key is an error, as Go's strict YAML decoding makes it there; relative file names are
relative to the file's folder.

Where Python's `ssl` cannot do what Go does, the file is refused with the reason instead of
served differently: RequestClientCert and RequireAnyClientCert (OpenSSL through Python asks
for a client certificate only to verify it), and more than one entry in curve_preferences on a
Python without SSLContext.set_groups. docs/deploy.md lists the differences.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import ssl
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporter.config import read_small_file
from exporter.internals import decode_certificate

log = logging.getLogger(__name__)


class WebConfigError(ValueError):
    """The web config cannot be used; str() is one line naming the file and the problem."""


# Go's tls.CipherSuites() (the ones exporter-toolkit accepts), by OpenSSL name. The TLS 1.3
# suites are accepted and, as in Go, change nothing: TLS 1.3's suites are not configurable.
GO_CIPHERS = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
}
GO_TLS13_CIPHERS = (
    "TLS_AES_128_GCM_SHA256",
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
)
GO_CURVES = {
    "CurveP256": "prime256v1",
    "CurveP384": "secp384r1",
    "CurveP521": "secp521r1",
    "X25519": "X25519",
}
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# client_auth_type -> Python's verify mode; None: Go can, Python's ssl cannot (module doc).
CLIENT_AUTH = {
    "": ssl.CERT_NONE,
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    "RequestClientCert": None,
    "RequireAnyClientCert": None,
    "RequireClientCert": None,  # exporter-toolkit's old name of RequireAnyClientCert
}
# exporter-toolkit's extraHTTPHeaders: the only headers the file may set, and their values
# where they are an enumeration.
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}
_KEYS = {
    "": {"tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"},
    "tls_server_config": {
        "cert",
        "key",
        "client_ca",
        "cert_file",
        "key_file",
        "client_auth_type",
        "client_ca_file",
        "client_allowed_sans",
        "min_version",
        "max_version",
        "cipher_suites",
        "prefer_server_cipher_suites",
        "curve_preferences",
    },
    "http_server_config": {"http2", "headers"},
    "rate_limit": {"interval", "burst"},
}
# A bcrypt hash as Go's bcrypt.Cost() accepts it: $2a$/$2b$/$2x$/$2y$, a cost, 53 characters.
_BCRYPT = re.compile(r"\$2[abxy]?\$(\d\d)\$[./A-Za-z0-9]{53}\Z")
# Go's time.ParseDuration units, for rate_limit.interval.
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class TlsSettings:
    """tls_server_config, checked; file names made absolute."""

    cert_file: str = ""
    key_file: str = ""
    cert: str = ""
    key: str = field(default="", repr=False)
    client_ca_file: str = ""
    client_ca: str = ""
    client_auth_type: str = "NoClientCert"
    client_allowed_sans: tuple[str, ...] | None = None
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True
    curve_preferences: tuple[str, ...] = ()

    def files(self) -> tuple[str, ...]:
        """The files a rotation replaces: watched for changes."""
        return tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f)


@dataclass(frozen=True)
class WebConfig:
    """One reading of the web config file."""

    path: str = ""
    tls: TlsSettings | None = None
    http2: bool = True
    headers: Mapping[str, str] = field(default_factory=dict)
    users: Mapping[str, str] = field(default_factory=dict, repr=False)  # name -> bcrypt hash
    rate_interval_s: float = 0.0  # 0: no rate limit
    rate_burst: int = 0

    @property
    def client_auth(self) -> str:
        return self.tls.client_auth_type if self.tls else "NoClientCert"


# A web config is a few hundred bytes (a thousand users' hashes fit in 100 KiB). It is parsed
# on the event loop when it changes: 10 MB of YAML stalled every request, /healthz included,
# for ~4 s (round 4). Past this it is refused, the last good one kept; read without blocking,
# a regular file only (a FIFO would hang the loop).
MAX_WEB_CONFIG_BYTES = 128 * 1024


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read and check the file; WebConfigError in one line if it cannot be served."""
    import yaml  # only where a web config is used

    name = str(path)
    try:
        text = read_small_file(name, MAX_WEB_CONFIG_BYTES, "a web config").decode()
    except IsADirectoryError:
        raise WebConfigError(f"web config {name}: is a directory") from None
    except OSError as exc:
        raise WebConfigError(f"web config {name}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise WebConfigError(f"web config {name}: not text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise WebConfigError(f"web config {name}: not YAML{where}") from None
    try:
        return _parse(data, Path(name).parent, name)
    except WebConfigError as exc:
        raise WebConfigError(f"web config {name}: {exc}") from None


def load_served(path: str | os.PathLike[str]) -> tuple[WebConfig, ssl.SSLContext | None]:
    """The file read and checked, and its TLS context built (its certificate, key and client
    CA read): what a server can use, or WebConfigError in one line naming the file."""
    config = load_web_config(path)
    if config.tls is None:
        return config, None
    try:
        return config, tls_context(config.tls)
    except WebConfigError as exc:
        raise WebConfigError(f"web config {path}: {exc}") from None


def _parse(data: Any, folder: Path, name: str) -> WebConfig:
    if data is None:  # an empty file: plain HTTP, no auth (exporter-toolkit's too)
        return WebConfig(path=name)
    _mapping(data, "")
    tls = _tls(_mapping(data.get("tls_server_config"), "tls_server_config"), folder)
    http = _mapping(data.get("http_server_config"), "http_server_config")
    users = data.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise WebConfigError("basic_auth_users: expected a map of user name to bcrypt hash")
    checked_users = {}
    for user, hashed in users.items():
        text = "" if hashed is None else str(hashed)
        match = _BCRYPT.match(text)
        if match is None or not 4 <= int(match.group(1)) <= 31:
            # The hash is not echoed: a password pasted by mistake must not reach a log.
            raise WebConfigError(
                f"basic_auth_users: the hash of user {user!r} is not a bcrypt hash"
            )
        checked_users[str(user)] = text
    rate = _mapping(data.get("rate_limit"), "rate_limit")
    return WebConfig(
        path=name,
        tls=tls,
        http2=_bool(http.get("http2", True), "http_server_config.http2"),
        headers=_headers(http.get("headers")),
        users=checked_users,
        rate_interval_s=_duration(rate.get("interval", 0), "rate_limit.interval"),
        rate_burst=_int(rate.get("burst", 0), "rate_limit.burst"),
    )


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where or 'the file'}: expected a map")
    unknown = sorted(str(k) for k in value if k not in _KEYS[where])
    if unknown:
        place = f" in {where}" if where else ""
        raise WebConfigError(f"unknown key {unknown[0]!r}{place}")
    return value


def _tls(data: dict[str, Any], folder: Path) -> TlsSettings | None:
    if not data or not any(
        data.get(k)
        for k in (
            "cert_file",
            "cert",
            "key_file",
            "key",
            "client_ca_file",
            "client_ca",
            "client_auth_type",
        )
    ):
        # exporter-toolkit's IsEnabled(): without any of these TLS is off.
        return None

    def path(key: str) -> str:
        value = _string(data.get(key), f"tls_server_config.{key}")
        return str(folder / value) if value and not os.path.isabs(value) else value

    settings = TlsSettings(
        cert_file=path("cert_file"),
        key_file=path("key_file"),
        cert=_string(data.get("cert"), "tls_server_config.cert"),
        key=_string(data.get("key"), "tls_server_config.key"),
        client_ca_file=path("client_ca_file"),
        client_ca=_string(data.get("client_ca"), "tls_server_config.client_ca"),
        client_auth_type=_string(data.get("client_auth_type"), "tls_server_config.client_auth_type")
        or "NoClientCert",
        client_allowed_sans=(
            None
            if data.get("client_allowed_sans") is None
            else _strings(data["client_allowed_sans"], "tls_server_config.client_allowed_sans")
        ),
        min_version=_string(data.get("min_version"), "tls_server_config.min_version") or "TLS12",
        max_version=_string(data.get("max_version"), "tls_server_config.max_version") or "TLS13",
        cipher_suites=_strings(data.get("cipher_suites") or [], "tls_server_config.cipher_suites"),
        prefer_server_cipher_suites=_bool(
            data.get("prefer_server_cipher_suites", True),
            "tls_server_config.prefer_server_cipher_suites",
        ),
        curve_preferences=_strings(
            data.get("curve_preferences") or [], "tls_server_config.curve_preferences"
        ),
    )
    _check_tls(settings)
    return settings


def _check_tls(tls: TlsSettings) -> None:
    """exporter-toolkit's checks (validateTLSPaths, ConfigToTLSConfig), in its words."""
    if not tls.cert_file and not tls.cert:
        raise WebConfigError("missing one of cert or cert_file")
    if not tls.key_file and not tls.key:
        raise WebConfigError("missing one of key or key_file")
    for version in (tls.min_version, tls.max_version):
        if version not in TLS_VERSIONS:
            raise WebConfigError(f"unknown TLS version: {version}")
    if TLS_VERSIONS[tls.min_version] > TLS_VERSIONS[tls.max_version]:
        raise WebConfigError("min_version is above max_version")
    for cipher in tls.cipher_suites:
        if cipher not in GO_CIPHERS and cipher not in GO_TLS13_CIPHERS:
            raise WebConfigError(f"unknown cipher: {cipher}")
    for curve in tls.curve_preferences:
        if curve not in GO_CURVES:
            raise WebConfigError(f"unknown curve: {curve}")
    if len(tls.curve_preferences) > 1 and not hasattr(ssl.SSLContext, "set_groups"):
        raise WebConfigError(
            "curve_preferences: this Python's ssl module sets one curve only; list one"
        )
    if tls.client_auth_type not in CLIENT_AUTH:
        raise WebConfigError(f"invalid ClientAuth: {tls.client_auth_type}")
    mode = CLIENT_AUTH[tls.client_auth_type]
    if mode is None:
        raise WebConfigError(
            f"client_auth_type {tls.client_auth_type} is not supported: Python's ssl module "
            "verifies every client certificate it asks for; use RequireAndVerifyClientCert "
            "or VerifyClientCertIfGiven with a client CA"
        )
    has_ca = bool(tls.client_ca_file or tls.client_ca)
    if has_ca and mode == ssl.CERT_NONE:
        raise WebConfigError("client CA's have been configured without a Client Auth Policy")
    if tls.client_allowed_sans is not None and mode == ssl.CERT_NONE:
        raise WebConfigError("client_allowed_sans needs a client_auth_type that verifies")


def _headers(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError("http_server_config.headers: expected a map")
    headers = {}
    for name, raw in value.items():
        text = "" if raw is None else str(raw)
        if name not in HEADERS:
            raise WebConfigError(f'HTTP header "{name}" can not be configured')
        allowed = HEADERS[name]
        if allowed and text not in allowed:
            raise WebConfigError(
                f"invalid value for {name}. Expected one of: {list(allowed)}, but got: {text!r}"
            )
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            raise WebConfigError(f"invalid value for {name}: control characters")
        if text:  # "Unset if blank."
            headers[str(name)] = text
    return headers


def _string(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        raise WebConfigError(f"{where}: expected a string")
    return str(value)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise WebConfigError(f"{where}: expected a list")
    return tuple(_string(v, where) for v in value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise WebConfigError(f"{where}: expected true or false")
    return value


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WebConfigError(f"{where}: expected a whole number")
    return value


def _duration(value: Any, where: str) -> float:
    """A Go duration ("1s", "1m30s", "250ms") or 0, in seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    text = str(value).strip()
    if not text or _DURATION.sub("", text):
        raise WebConfigError(f"{where}: expected a duration like 1s or 250ms, got {text!r}")
    return sum(float(n) * _UNIT_S[u] for n, u in _DURATION.findall(text))


# -- TLS contexts -------------------------------------------------------------------------


def tls_context(tls: TlsSettings) -> ssl.SSLContext:
    """A server context for `tls`: files read now (WebConfigError if they cannot be used)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[tls.min_version]
    context.maximum_version = TLS_VERSIONS[tls.max_version]
    ciphers = [GO_CIPHERS[c] for c in tls.cipher_suites if c in GO_CIPHERS]
    if ciphers:
        try:
            context.set_ciphers(":".join(ciphers))
        except ssl.SSLError:
            raise WebConfigError(
                "cipher_suites: none of them is available in this OpenSSL"
            ) from None
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    if tls.curve_preferences:
        groups = [GO_CURVES[c] for c in tls.curve_preferences]
        if len(groups) > 1:
            context.set_groups(":".join(groups))  # type: ignore[attr-defined]
        else:
            context.set_ecdh_curve(groups[0])
    with _pem_file(tls.cert_file, tls.cert) as cert, _pem_file(tls.key_file, tls.key) as key:
        if tls.key_file:
            _check_key_file(tls.key_file)
        try:
            context.load_cert_chain(cert, key)
        except FileNotFoundError:
            missing = cert if not os.path.exists(cert) else key
            raise WebConfigError(f"cannot read {missing}: no such file") from None
        except IsADirectoryError as exc:
            raise WebConfigError(
                f"{exc.filename or 'a certificate or key file'} is a directory"
            ) from None
        except PermissionError as exc:
            raise WebConfigError(f"cannot read {exc.filename}: permission denied") from None
        except ssl.SSLError as exc:
            raise WebConfigError(
                f"failed to load the certificate and key: {_ssl_reason(exc)}"
            ) from None
        not_after = certificate_not_after(cert)
    if not_after is not None and not_after < time.time():
        expired = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(not_after))
        raise WebConfigError(f"the certificate expired at {expired}")
    mode = CLIENT_AUTH[tls.client_auth_type]
    assert mode is not None  # _check_tls refused the others
    if tls.client_ca_file or tls.client_ca:
        try:
            if tls.client_ca_file:
                context.load_verify_locations(cafile=tls.client_ca_file)
            else:
                context.load_verify_locations(cadata=tls.client_ca)
        except ssl.SSLError as exc:
            raise WebConfigError(f"client CA: {_ssl_reason(exc)}") from None
        except OSError as exc:
            where = tls.client_ca_file or "client_ca"
            raise WebConfigError(f"cannot read client CA {where}: {exc.strerror}") from None
        if not context.get_ca_certs():
            raise WebConfigError("client CA: no certificate in it")
    elif mode != ssl.CERT_NONE:
        # As Go does without ClientCAs: the system's roots (any publicly trusted client
        # certificate passes, which is rarely what is meant: said once per load).
        context.load_default_certs(ssl.Purpose.CLIENT_AUTH)
        log.warning(
            "client_auth_type %s without client_ca_file: client certificates are verified "
            "against the system's CAs",
            tls.client_auth_type,
        )
    context.verify_mode = mode
    # HTTP/1.1 only: this server does not speak HTTP/2 (http2 is accepted and means "allowed").
    context.set_alpn_protocols(["http/1.1"])
    return context


class _pem_file:
    """A path to the PEM: the file itself, or inline text in an anonymous memory file (Python's
    ssl loads certificates and keys only from paths)."""

    def __init__(self, path: str, inline: str) -> None:
        self.path, self.inline, self.fd = path, inline, -1

    def __enter__(self) -> str:
        if self.path:
            return self.path
        self.fd = os.memfd_create("gpumem-web-pem", os.MFD_CLOEXEC)
        os.write(self.fd, self.inline.encode())
        return f"/proc/self/fd/{self.fd}"

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)


_warned_readable: set[str] = set()


def _check_key_file(path: str) -> None:
    """Whoever may write the key can impersonate the server: refused. One that every user can
    read is said once (a Kubernetes Secret is mounted 0644 unless defaultMode says otherwise)."""
    try:
        info = os.stat(path)
    except OSError:
        return  # load_cert_chain says what is wrong with it
    if not stat.S_ISREG(info.st_mode):
        raise WebConfigError(f"key_file {path} is not a regular file")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise WebConfigError(f"key_file {path} may be written by other users: chmod go-w it")
    if info.st_mode & stat.S_IROTH and path not in _warned_readable:
        _warned_readable.add(path)
        log.warning("TLS key_file %s is readable by every user of this host: chmod o-r it", path)


def certificate_not_after(path: str) -> float | None:
    """The certificate's notAfter as Unix time, or None where it cannot be read."""
    try:
        decoded = decode_certificate(path)
        return float(ssl.cert_time_to_seconds(decoded["notAfter"]))
    except (AttributeError, KeyError, ValueError, OSError, ssl.SSLError):
        return None


def _ssl_reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.strerror or exc).lower().replace("_", " ")


def san_allowed(peercert: Mapping[str, Any] | None, allowed: tuple[str, ...]) -> bool:
    """exporter-toolkit's VerifyPeerCertificate: a DNS, IP, e-mail or URI SAN of the client's
    certificate equals an entry of client_allowed_sans. IP addresses compare as addresses
    (OpenSSL writes IPv6 in its own form, Go in the canonical one)."""
    names = []
    for kind, value in (peercert or {}).get("subjectAltName", ()):
        if kind == "IP Address":
            names.append(_canonical_ip(value))
        elif kind in ("DNS", "email", "URI"):
            names.append(value)
    wanted = {_canonical_ip(a) for a in allowed}
    return any(n in wanted for n in names)


def _canonical_ip(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        return text
