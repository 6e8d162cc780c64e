"""A server that serves /metrics the way vLLM does with PROMETHEUS_MULTIPROC_DIR set, for
tests/test_multiprocess.py (`uvicorn tests.support.mp_attach_app:app --workers 2`).

vLLM's mount_metrics (vllm/entrypoints/openai/api_server.py): a fresh registry holding only a
MultiProcessCollector, mounted at /metrics, the mount's regex widened so that /metrics itself
needs no redirect. Then each worker calls exporter.attach(app), as a user adding the exporter
to such a server would.
"""

import os
import re

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, make_asgi_app, multiprocess
from starlette.routing import Mount

import exporter

app = FastAPI()
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
metrics_route = Mount("/metrics", make_asgi_app(registry=registry))
metrics_route.path_regex = re.compile("^/metrics(?P<path>.*)$")
app.routes.append(metrics_route)

# The app's own metric, written to the folder by prometheus_client itself.
PINGS = Counter("app_pings", "Pings the app answered.")


@app.get("/ping")
def ping() -> dict[str, int]:
    PINGS.inc()
    return {"pid": os.getpid()}


exporter.attach(app)
