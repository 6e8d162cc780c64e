"""The Helm chart rendered as an install would (helm-python-sdk: Helm's Go library, bundled),
for the chart's tests and for end-to-end tests that use what it renders."""

from __future__ import annotations

from typing import Any

import yaml

from tests.conftest import REPO_ROOT
from tests.helpers import require_module

helm = require_module("helm_python", "helm-python-sdk")

CHART = REPO_ROOT / "deploy" / "helm" / "gpumem-exporter"
RELEASE = "gm"
NAMESPACE = "monitoring"
# TLS from a Secret of yours, client certificates required.
REQUIRED_CLIENT_CERT: dict[str, Any] = {
    "tls": {
        "enabled": True,
        "existingSecret": "exporter-tls",
        "clientAuthType": "RequireAndVerifyClientCert",
        "clientCA": {"existingSecret": "prometheus-client-ca"},
    }
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Render the chart as an install would and return its objects (NOTES.txt left out)."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: list[Any] = []
    for path, text in sorted(manifests.items()):
        if not path.endswith(".yaml"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]
