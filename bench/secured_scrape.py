"""What the web config costs a scrape: plain HTTP, TLS, TLS with a client certificate, and
basic auth, each served by `gpumem-exporter demo` in a process of its own (no GPU needed).

Two clients per arm: one that keeps its connection (as Prometheus does: the cost is the
record layer and the auth check), and one that connects for every scrape (a handshake each:
what a client without keep-alive, or a certificate rotation, costs). Latency from the
client's side; the exporter's CPU per scrape from its /proc stat.

    python -m bench.secured_scrape --scrapes 400

One JSON object on stdout: per arm, p50/p99 (ms) of each client and CPU ms per scrape.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import free_port, summary

REPO = Path(__file__).resolve().parent.parent
ACCEPT = "application/openmetrics-text;version=1.0.0;q=0.9,text/plain;version=0.0.4;q=0.5"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _pki(folder: Path) -> dict[str, Path]:
    files = {n: folder / n for n in ("ca.crt", "ca.key", "s.crt", "s.key", "c.crt", "c.key")}
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    _openssl("req", "-x509", *ec, "-days", "2", "-subj", "/CN=ca",
             "-keyout", str(files["ca.key"]), "-out", str(files["ca.crt"]))  # fmt: skip
    for name, san in (("s", "DNS:localhost,IP:127.0.0.1"), ("c", "DNS:prometheus")):
        csr, ext = folder / f"{name}.csr", folder / f"{name}.ext"
        ext.write_text(f"subjectAltName={san}\n")
        _openssl("req", *ec, "-subj", f"/CN={name}", "-keyout", str(files[f"{name}.key"]),
                 "-out", str(csr))  # fmt: skip
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(files["ca.crt"]), "-CAkey",
                 str(files["ca.key"]), "-CAcreateserial", "-days", "2", "-extfile", str(ext),
                 "-out", str(files[f"{name}.crt"]))  # fmt: skip
        os.chmod(files[f"{name}.key"], 0o600)
    return files


def _arms(folder: Path, pki: dict[str, Path]) -> dict[str, str]:
    import bcrypt

    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(10)).decode()
    tls = f"tls_server_config:\n  cert_file: {pki['s.crt']}\n  key_file: {pki['s.key']}\n"
    mtls = (
        tls + f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki['ca.crt']}\n"
    )
    users = f"basic_auth_users:\n  prometheus: {hashed}\n"
    return {"plain": "", "basic": users, "tls": tls, "mtls": mtls, "mtls+basic": mtls + users}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    name: str, config: str, folder: Path, pki: dict[str, Path], scrapes: int
) -> dict[str, Any]:
    port = free_port()
    args = [sys.executable, "-m", "exporter.cli", "demo", "--port", str(port)]
    if config:
        path = folder / f"{name}.yml"
        path.write_text(config)
        args += ["--web-config-file", str(path)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    server = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    context = None
    if "tls" in name:
        context = ssl.create_default_context(cafile=str(pki["ca.crt"]))
        context.load_cert_chain(pki["c.crt"], pki["c.key"])
    headers = {"Host": "localhost", "Accept": ACCEPT, "Accept-Encoding": "gzip"}
    if "basic" in name:
        headers["Authorization"] = "Basic " + base64.b64encode(b"prometheus:pw").decode()

    def connect() -> http.client.HTTPConnection:
        if context is not None:
            return http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
        return http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def scrape(connection: http.client.HTTPConnection) -> float:
        started = time.perf_counter()
        connection.request("GET", "/metrics", headers=headers)
        response = connection.getresponse()
        response.read()
        assert response.status == 200, response.status
        return (time.perf_counter() - started) * 1e3

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                scrape(connect())
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        kept = connect()
        for _ in range(20):  # warm: the first password's bcrypt, the first render
            scrape(kept)
        cpu0 = _cpu_s(server.pid)
        kept_ms = [scrape(kept) for _ in range(scrapes)]
        cpu_kept = (_cpu_s(server.pid) - cpu0) / scrapes * 1e3
        fresh_ms = []
        cpu0 = _cpu_s(server.pid)
        for _ in range(scrapes // 4):
            started = time.perf_counter()
            connection = connect()
            scrape(connection)
            connection.close()
            fresh_ms.append((time.perf_counter() - started) * 1e3)
        cpu_fresh = (_cpu_s(server.pid) - cpu0) / (scrapes // 4) * 1e3
    finally:
        server.terminate()
        server.wait(10)
    return {
        "kept_alive_ms": summary(kept_ms),
        "new_connection_ms": summary(fresh_ms),
        "exporter_cpu_ms_per_scrape_kept_alive": round(cpu_kept, 3),
        "exporter_cpu_ms_per_scrape_new_connection": round(cpu_fresh, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scrapes", type=int, default=400)
    args = parser.parse_args()
    if shutil.which("openssl") is None:
        sys.exit("openssl is needed to make the certificates")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        pki = _pki(folder)
        result = {
            name: measure(name, config, folder, pki, args.scrapes)
            for name, config in _arms(folder, pki).items()
        }
    print(
        json.dumps(
            {"python": sys.version.split()[0], "openssl": ssl.OPENSSL_VERSION, **result}, indent=1
        )
    )


if __name__ == "__main__":
    main()
