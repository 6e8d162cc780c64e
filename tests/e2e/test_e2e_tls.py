"""A real Prometheus (Debian package `prometheus`) scrapes the exporter over TLS with a client
certificate and with basic auth, with its own `tls_config` and `basic_auth`; a job with the wrong
password, and one without a client certificate, are refused and shown down with the reason."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator

import bcrypt
import pytest
import yaml

from tests.conftest import require_tool
from tests.helpers import (
    free_port,
    prometheus_api,
    start_prometheus,
    stop_processes,
    wait_http,
)
from tests.support.chart import REQUIRED_CLIENT_CERT, one, render
from tests.support.pki import Authority, web_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHART_VALUES = {
    "web": REQUIRED_CLIENT_CERT,
    "serviceMonitor": {"clientCertificate": {"existingSecret": "prometheus-client"}},
}
CHART_SERVER_NAME = "gm-gpumem-exporter.monitoring.svc"


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> Iterator[dict[str, dict]]:
    prometheus = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("e2e-tls")
    ca = Authority(tmp / "pki")
    # The chart's Service name too: the rendered ServiceMonitor checks it (serverName).
    sans = f"DNS:localhost,IP:127.0.0.1,DNS:{CHART_SERVER_NAME}"
    server, client = ca.issue("exporter", sans), ca.issue("prometheus", "DNS:prometheus")
    (tmp / "password").write_text("scrape-password\n")
    (tmp / "wrong").write_text("not-it\n")
    hashed = bcrypt.hashpw(b"scrape-password", bcrypt.gensalt(10)).decode()
    config = web_config(
        tmp,
        f"tls_server_config:\n  cert_file: {server.cert}\n  key_file: {server.key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {ca.cert}\n"
        "  client_allowed_sans: [prometheus]\n"
        f"basic_auth_users:\n  prometheus: {hashed}\n",
    )
    # What the chart renders for docs/deploy.md's mTLS set-up, its Secrets read as the
    # Prometheus Operator reads them: each (name, key) a file.
    files = {
        ("exporter-tls", "ca.crt"): ca.cert,
        ("prometheus-client", "tls.crt"): client.cert,
        ("prometheus-client", "tls.key"): client.key,
    }
    endpoint = one(render(CHART_VALUES), "ServiceMonitor")["spec"]["endpoints"][0]
    rendered = endpoint["tlsConfig"]

    def file_of(ref: dict[str, str]) -> str:
        return str(files[(ref["name"], ref["key"])])

    chart_tls = {
        "ca_file": file_of(rendered["ca"]["secret"]),
        "cert_file": file_of(rendered["cert"]["secret"]),
        "key_file": file_of(rendered["keySecret"]),
        "server_name": rendered["serverName"],
    }
    exporter_port, prometheus_port = free_port(), free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "demo", "--port", str(exporter_port),
         "--web-config-file", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    tls = {
        "ca_file": str(ca.cert),
        "cert_file": str(client.cert),
        "key_file": str(client.key),
        "server_name": "localhost",
    }

    def job(name: str, **more: object) -> dict:
        return {
            "job_name": name,
            "scheme": "https",
            "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}],
            **more,
        }

    good_auth = {"username": "prometheus", "password_file": str(tmp / "password")}

    scrape = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            job("secured", tls_config=tls, basic_auth=good_auth),
            job("wrong-password", tls_config=tls,
                basic_auth={"username": "prometheus", "password_file": str(tmp / "wrong")}),
            job("no-client-cert", tls_config={"ca_file": str(ca.cert), "server_name": "localhost"},
                basic_auth=good_auth),
            job("chart-rendered", tls_config=chart_tls, basic_auth=good_auth,
                scheme=endpoint["scheme"]),
        ],
    }  # fmt: skip
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(scrape))
    server_proc = start_prometheus(prometheus, tmp, prometheus_port)
    context = ssl.create_default_context(cafile=str(ca.cert))
    context.load_cert_chain(client.cert, client.key)
    context.check_hostname = False
    try:
        wait_http(f"https://127.0.0.1:{exporter_port}/readyz", exporter, context=context)
        url = f"http://127.0.0.1:{prometheus_port}"
        deadline = time.monotonic() + 60
        while True:
            active = prometheus_api(url, "targets")["activeTargets"]
            by_job = {t["labels"]["job"]: t for t in active}
            if len(by_job) == 4 and all(t["health"] != "unknown" for t in by_job.values()):
                break
            assert time.monotonic() < deadline, active
            time.sleep(0.5)
        time.sleep(2)  # a few scrapes each
        by_job = {t["labels"]["job"]: t for t in prometheus_api(url, "targets")["activeTargets"]}
        by_job["_prometheus"] = {"url": url}
        yield by_job
    finally:
        stop_processes((server_proc, exporter))
        shutil.rmtree(tmp, ignore_errors=True)


def test_prometheus_scrapes_over_tls_with_its_client_certificate_and_basic_auth(targets):
    assert targets["secured"]["health"] == "up", targets["secured"]["lastError"]
    result = prometheus_api(
        targets["_prometheus"]["url"], "query", query='gpumem_exporter_web_info{job="secured"}'
    )["result"]
    assert len(result) == 1
    labels = result[0]["metric"]
    assert labels["tls"] == "on" and labels["basic_auth"] == "on"
    assert labels["client_auth"] == "RequireAndVerifyClientCert"


def test_the_wrong_password_is_down_with_401(targets):
    target = targets["wrong-password"]
    assert target["health"] == "down" and "401" in target["lastError"]


def test_no_client_certificate_is_refused_at_the_handshake(targets):
    target = targets["no-client-cert"]
    assert target["health"] == "down"
    # The TLS alert reaches the client (asyncio alone would reset the connection).
    assert "certificate required" in target["lastError"], target["lastError"]


def test_prometheus_scrapes_with_the_tls_settings_the_chart_renders(targets):
    """Client certificates required: the ServiceMonitor the chart renders (its Secrets as
    files) scrapes; before, it presented no certificate and was refused."""
    target = targets["chart-rendered"]
    assert target["health"] == "up", target["lastError"]
