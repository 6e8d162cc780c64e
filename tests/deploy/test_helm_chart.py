"""The Helm chart in deploy/helm/gpumem-exporter: lint, render and validate, offline.

Rendering and linting go through helm-python-sdk (Helm's Go library, bundled: no helm binary).
Core objects are checked with kubernetes-validate in strict mode (unknown fields fail) against
the oldest Kubernetes the chart supports and the newest the package knows. ServiceMonitor,
PodMonitor and PrometheusRule are checked against the Prometheus Operator's CRD schemas
(tests/js, `npm ci --prefix tests/js`): values through the models' validate(), unknown keys
through TypeScript's excess-property checks on the models' types.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.helpers import JS_DIR, require_js_deps, require_module, run_tsc
from tests.support.chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    REQUIRED_CLIENT_CERT,
    by_kind,
    helm,
    one,
    render,
)

kubernetes_validate = require_module("kubernetes_validate", "kubernetes-validate")

RULES_DIR = REPO_ROOT / "deploy" / "prometheus"
DASHBOARDS_DIR = REPO_ROOT / "dashboards"
# The chart's kubeVersion floor and the newest schema kubernetes-validate ships.
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
# Custom resources checked against their CRD schemas (tests/js) with the monitoring kinds.
CRD_KINDS = MONITORING_KINDS | {"Certificate"}
CHART_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
RUNBOOK_URL_BASE = "https://git.example.com/ml/gpumem-exporter/blob/main/docs/runbooks.md"

BCRYPT = "$2y$10$mDwo.lAisC94iLAyP81MCesa29IzH37oigHC/42V2pdJlUprsJPze"
# TLS from cert-manager, client certificates, basic auth and Kubernetes admin identities.
SECURED: dict[str, Any] = {
    "web": {
        "tls": {
            "enabled": True,
            "certManager": {"enabled": True, "issuerRef": {"name": "cluster-ca"}},
            "clientAuthType": "RequireAndVerifyClientCert",
            "clientCA": {"existingSecret": "prometheus-client-ca"},
            "clientAllowedSans": ["prometheus"],
        },
        "basicAuth": {"users": {"prometheus": BCRYPT}},
    },
    "serviceMonitor": {
        "basicAuth": {
            "username": {"name": "scrape-auth", "key": "username"},
            "password": {"name": "scrape-auth", "key": "password"},
        },
        "tlsConfig": {
            "ca": {"secret": {"name": "gm-gpumem-exporter-tls", "key": "ca.crt"}},
            "cert": {"secret": {"name": "prometheus-client", "key": "tls.crt"}},
            "keySecret": {"name": "prometheus-client", "key": "tls.key"},
            "serverName": "gm-gpumem-exporter.monitoring.svc",
        },
    },
    "podMonitor": {
        "scheme": "https",
        "tlsConfig": {"ca": {"configMap": {"name": "inference-ca", "key": "ca.crt"}}},
    },
    "adminAuth": {"kubernetes": {"enabled": True}},
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "client-cert-required": {
        "web": REQUIRED_CLIENT_CERT,
        "serviceMonitor": {"clientCertificate": {"existingSecret": "prometheus-client"}},
    },
    "host-pid": {"daemonset": {"hostPID": True}},
    "no-kubelet": {"daemonset": {"kubelet": {"enabled": False}}},
    "pod-reader": {"daemonset": {"kubelet": {"podReader": True}}},
    "claim-reader": {"daemonset": {"kubelet": {"podReader": True, "claimReader": True}}},
    "microk8s-kubelet": {
        "daemonset": {
            "kubelet": {
                "hostPath": "/var/snap/microk8s/common/var/lib/kubelet/pod-resources",
                "refreshSeconds": 30,
                "timeoutSeconds": 2,
                "extraResources": ["example.com/gpu", "amd.com/*"],
            }
        }
    },
    "existing-secret": {"adminToken": {"existingSecret": "gpumem-admin", "secretKey": "bearer"}},
    "chart-secret": {"adminToken": {"value": "not-a-real-token"}},
    "service-monitor-off": {"serviceMonitor": {"enabled": False}},
    "tls-existing-secret": {"web": {"tls": {"enabled": True, "existingSecret": "exporter-tls"}}},
    "secured": SECURED,
    "custom-pod-monitor": {
        "podMonitor": {
            "namespace": "observability",
            "additionalLabels": {"release": "kube-prometheus-stack"},
            "selector": {
                # Helm merges maps with the defaults: null drops the default label.
                "matchLabels": {
                    "gpumem-exporter/scrape": None,
                    "app.kubernetes.io/component": "inference",
                },
                "matchExpressions": [{"key": "model", "operator": "In", "values": ["llama3"]}],
            },
            "namespaceSelector": {"matchNames": ["inference", "batch"]},
            "portName": "metrics",
            "path": "/metrics",
            "interval": "30s",
            "scrapeTimeout": "20s",
            "podTargetLabels": ["model"],
            "relabelings": [
                {
                    "action": "replace",
                    "sourceLabels": ["__meta_kubernetes_pod_label_model"],
                    "targetLabel": "model",
                },
            ],
            "metricRelabelings": [
                {"action": "drop", "sourceLabels": ["__name__"], "regex": "process_.*"},
            ],
        },
    },
    "custom-scheduling": {
        "daemonset": {
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
                {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
            ],
            "nodeSelector": {
                "nvidia.com/gpu.present": None,
                "node.kubernetes.io/instance-type": "p5.48xlarge",
            },
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "nvidia.com/gpu.count",
                                        "operator": "Gt",
                                        "values": ["0"],
                                    },
                                ]
                            }
                        ],
                    },
                },
            },
            "runtimeClassName": "",
            "nvidiaVisibleDevices": "",
            "nvidiaDriverCapabilities": "",
            "priorityClassName": "system-node-critical",
            "labels": {"cluster_zone": "eu-west-4a", "tier": "prod"},
            "extraArgs": ["--log-level", "debug"],
            "extraEnv": [{"name": "GPUMEM_EXTRA", "value": "1"}],
            "resources": {
                "requests": {"cpu": "50m", "memory": "96Mi"},
                "limits": {"cpu": "1", "memory": "512Mi"},
            },
            "podAnnotations": {"example.com/team": "ml-platform"},
        },
    },
    "overrides": {
        "fullnameOverride": "gpumem",
        "commonLabels": {"team": "ml-platform"},
        "image": {
            "repository": "registry.example.com/gpumem-exporter",
            "digest": "sha256:" + "a" * 64,
        },
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccount": {"create": False, "name": "gpumem-reader"},
        "service": {"clusterIP": ""},
        "serviceMonitor": {
            "namespace": "observability",
            "additionalLabels": {"release": "kps"},
            "targetLabels": ["app.kubernetes.io/instance"],
        },
        "prometheusRule": {
            "additionalLabels": {"release": "kps"},
            "additionalAlertLabels": {"team": "ml-platform"},
        },
        "dashboards": {"namespace": "grafana", "annotations": {"grafana_folder": "GPU"}},
    },
    "kube-prometheus-stack": {
        "kubePrometheusStackRelease": "kps",
        "runbookUrlBase": RUNBOOK_URL_BASE,
        "serviceMonitor": {"additionalLabels": {"release": "mine", "team": "ml-platform"}},
        "podMonitor": {"additionalLabels": {"prometheus": "gpu"}},
        "prometheusRule": {"additionalLabels": {"role": "alert-rules"}},
    },
    "node-daemon-off": {"daemonset": {"enabled": False}},
    "only-node-daemon": {
        "podMonitor": {"enabled": False},
        "prometheusRule": {"enabled": False},
        "dashboards": {"enabled": False},
    },
}


def render_notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]


def env_of(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(docs).get("env", [])}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


# --- lint and schema ----------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict(name: str) -> None:
    report = helm.lint(
        CHART,
        VALUE_SETS[name],
        strict=True,
        namespace=NAMESPACE,
        kube_version="v" + KUBE_VERSIONS[0],
    )
    # Severity 1 is informational ("icon is recommended"); 2 warning, 3 error.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems, problems
    assert not report["errors"], report["errors"]
    assert report["total_charts_linted"] == 1


def test_yaml_style() -> None:
    yamllint = require_module("yamllint.linter", "yamllint")
    config = require_module("yamllint.config", "yamllint").YamlLintConfig(
        "{extends: default, rules: {line-length: {max: 100}, document-start: disable}}"
    )
    for name in ("Chart.yaml", "values.yaml"):
        problems = list(yamllint.run((CHART / name).read_text(), config))
        assert not problems, f"{name}: {[str(p) for p in problems]}"


def _object_schemas(schema: Any, path: str = "$") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(schema, dict):
        if schema.get("type") == "object" and "properties" in schema:
            yield path, schema
        for key, value in schema.items():
            yield from _object_schemas(value, f"{path}.{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            yield from _object_schemas(value, f"{path}[{i}]")


def test_values_schema_is_strict() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = [
        path
        for path, obj in _object_schemas(schema)
        if obj.get("additionalProperties") is not False
        # a K8s EnvVar: passed through as is, "name" required
        and not path.endswith("extraEnv.items")
    ]
    assert not open_objects, f"objects that accept unknown keys: {open_objects}"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"]), "values.yaml keys missing from the schema"
    for key, sub in values.items():
        if isinstance(sub, dict) and "properties" in schema["properties"][key]:
            missing = set(sub) - set(schema["properties"][key]["properties"])
            assert not missing, f"{key}: {missing} not described in values.schema.json"


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"daemonSet": {"enabled": True}}, "daemonSet"),
        ({"daemonset": {"hostPid": True}}, "hostPid"),
        ({"daemonset": {"hostPID": "yes"}}, "hostPID"),
        ({"daemonset": {"port": 70000}}, "port"),
        ({"daemonset": {"intervalSeconds": 0}}, "intervalSeconds"),
        ({"daemonset": {"detail": "everything"}}, "detail"),
        ({"daemonset": {"tolerations": [{"key": "a", "operator": "Maybe"}]}}, "operator"),
        ({"serviceMonitor": {"interval": "15 seconds"}}, "interval"),
        ({"podMonitor": {"portName": "gpumem-metrics-port"}}, "portName"),
        # An empty selector would scrape every pod of the cluster.
        ({"podMonitor": {"selector": {"matchLabels": None}}}, "selector"),
        ({"podMonitor": {"relabelings": [{"source_labels": ["a"]}]}}, "source_labels"),
        ({"image": {"digest": "latest"}}, "digest"),
        ({"adminToken": {"secretKey": ""}}, "secretKey"),
        # Renamed to additionalLabels, as dcgm-exporter's and nvidia_gpu_exporter's charts say.
        ({"serviceMonitor": {"labels": {"release": "kps"}}}, "labels"),
        ({"podMonitor": {"additionalLabels": {"tier": 1}}}, "tier"),
        ({"kubePrometheusStackRelease": "kube prometheus"}, "kubePrometheusStackRelease"),
        ({"runbookUrlBase": "git.example.com/runbooks.md"}, "runbookUrlBase"),
        ({"runbookUrlBase": "https://git.example.com/runbooks.md#top"}, "runbookUrlBase"),
    ],
)
def test_values_schema_rejects(values: dict[str, Any], fragment: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as excinfo:
        chart.validate_schema(values)
    assert fragment in str(excinfo.value)


def test_conflicting_values_fail_render() -> None:
    with pytest.raises(helm.HelmRenderError, match="either value or existingSecret"):
        render({"adminToken": {"value": "t", "existingSecret": "s"}})
    with pytest.raises(helm.HelmRenderError, match=r"needs service\.enabled"):
        render({"service": {"enabled": False}})


# --- rendered objects are valid Kubernetes --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", VALUE_SETS)
def test_core_objects_validate(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    docs = rendered[name]
    assert docs
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert doc["metadata"]["labels"]["helm.sh/chart"] == f"gpumem-exporter-{CHART_VERSION}"
        if doc["kind"] in CRD_KINDS:
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(
                    f"{doc['kind']}/{doc['metadata']['name']} on {version}: "
                    f"{err.message} at {list(err.path)}"
                )


def _monitoring_objects(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    objects = [doc for docs in rendered.values() for doc in docs if doc["kind"] in CRD_KINDS]
    assert {doc["kind"] for doc in objects} == CRD_KINDS
    return objects


@pytest.mark.slow
def test_monitoring_objects_match_crd_schemas(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    node = require_js_deps()
    objects = _monitoring_objects(rendered)
    docs_file = tmp_path / "monitoring.json"
    docs_file.write_text(json.dumps(objects))
    result = subprocess.run(
        [node, str(JS_DIR / "validate-monitoring.mjs"), str(docs_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"checked {len(objects)} object(s), 0 problem(s)" in result.stdout


@pytest.mark.slow
def test_monitoring_objects_have_no_unknown_keys(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    lines = ['import type * as m from "./types/monitoring.js";']
    for i, doc in enumerate(_monitoring_objects(rendered)):
        lines.append(f"export const o{i}: m.Strict{doc['kind']} = {json.dumps(doc)};")
    output = run_tsc(tmp_path, {"monitoring.ts": "\n".join(lines) + "\n"})
    assert output == "", output


# --- what the objects say ------------------------------------------------------------------


def test_default_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    assert sorted(doc["kind"] for doc in docs) == [
        "ConfigMap",
        "DaemonSet",
        "PodMonitor",
        "PrometheusRule",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
    ]
    assert not by_kind(docs, "Secret")
    for doc in docs:
        assert doc["metadata"]["namespace"] == NAMESPACE


def test_daemonset_runs_node_daemon(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    c = container(docs)
    assert c["image"] == "gpumem-exporter:0.1.0"
    assert c["args"] == ["serve", "--host", "0.0.0.0", "--port", "9445", "--interval-s", "1"]
    assert "command" not in c, "the image's ENTRYPOINT (gpumem-exporter) must stay"
    assert c["ports"] == [{"name": "metrics", "containerPort": 9445, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert env_of(docs)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env_of(docs)["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "GPUMEM_ADMIN_TOKEN_FILE" not in env_of(docs)
    assert "GPUMEM_LABELS" not in env_of(docs)
    assert env_of(docs)["GPUMEM_DETAIL"] == "basic"  # the fleet's series budget
    assert env_of(render({"daemonset": {"detail": "full"}}))["GPUMEM_DETAIL"] == "full"
    assert "nvidia.com/gpu" not in str(c.get("resources")), "a monitor must not take a GPU"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["hostPID"] is False
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        pod["tolerations"]
    )


def test_kubelet_attribution_mounts_the_folder_read_only(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["defaults"]
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    c = container(docs)
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "pod-resources"]
    assert mount == {
        "name": "pod-resources",
        "mountPath": "/var/lib/kubelet/pod-resources",
        "readOnly": True,
    }
    [volume] = [v for v in pod["volumes"] if v["name"] == "pod-resources"]
    # The folder, not the socket: a kubelet restart replaces the socket file.
    assert volume["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}
    env = env_of(docs)
    assert env["GPUMEM_KUBELET_SOCKET"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert env["GPUMEM_KUBELET_REFRESH_S"] == "10"
    assert env["GPUMEM_KUBELET_TIMEOUT_S"] == "5"
    assert "GPUMEM_KUBELET_RESOURCES" not in env
    [node] = [e for e in c["env"] if e["name"] == "NODE_NAME"]
    assert node["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # The socket is root's: uid 0 in this container, still without any capability.
    assert c["securityContext"]["runAsUser"] == 0
    assert c["securityContext"]["runAsNonRoot"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    monitor = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert monitor["honorLabels"] is True  # keeps gpu_pod_info's pod/namespace/container
    assert "Pod attribution reads the kubelet" in render_notes()

    custom = rendered["microk8s-kubelet"]
    [volume] = [
        v
        for v in one(custom, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "pod-resources"
    ]
    assert volume["hostPath"]["path"] == "/var/snap/microk8s/common/var/lib/kubelet/pod-resources"
    env = env_of(custom)
    assert env["GPUMEM_KUBELET_REFRESH_S"] == "30"
    assert env["GPUMEM_KUBELET_TIMEOUT_S"] == "2"
    assert env["GPUMEM_KUBELET_RESOURCES"] == "example.com/gpu,amd.com/*"


def test_kubelet_attribution_off_keeps_the_daemon_non_root(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["no-kubelet"]
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    c = container(docs)
    assert env_of(docs)["GPUMEM_KUBELET_SOCKET"] == "off"
    assert not [v for v in pod["volumes"] if v["name"] == "pod-resources"]
    assert "runAsUser" not in c["securityContext"]
    assert c["securityContext"]["runAsNonRoot"] is True


def test_the_pod_reader_may_list_pods_and_nothing_else(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["pod-reader"]
    role = one(docs, "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = one(docs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": NAMESPACE}
    ]
    assert env_of(docs)["GPUMEM_KUBELET_POD_READER"] == "1"
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert not by_kind(rendered["defaults"], "ClusterRole")
    assert "GPUMEM_KUBELET_POD_READER" not in env_of(rendered["defaults"])


def test_the_claim_reader_may_list_resourceclaims_and_nothing_else(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["claim-reader"]
    roles = {d["metadata"]["name"]: d["rules"] for d in by_kind(docs, "ClusterRole")}
    [claims] = [rules for name, rules in roles.items() if name.endswith("-claim-reader")]
    assert claims == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims", "resourceslices"],
            "verbs": ["get", "list"],
        }
    ]
    bound = {d["roleRef"]["name"] for d in by_kind(docs, "ClusterRoleBinding")}
    assert bound == set(roles)
    assert env_of(docs)["GPUMEM_KUBELET_CLAIM_READER"] == "1"
    assert "GPUMEM_KUBELET_CLAIM_READER" not in env_of(rendered["pod-reader"])
    assert len(by_kind(rendered["pod-reader"], "ClusterRole")) == 1


def test_kubelet_values_are_validated() -> None:
    for bad, where in (
        ({"hostPath": "relative/path"}, "hostPath"),
        ({"refreshSeconds": 0}, "refreshSeconds"),
        ({"extraResources": ["no-slash"]}, "extraResources"),
        ({"socket": "/x"}, "socket"),
    ):
        with pytest.raises(Exception, match=f"/daemonset/kubelet.*{where}|{where}.*not allowed"):
            render({"daemonset": {"kubelet": bad}})


def test_security_context(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, docs in rendered.items():
        if not by_kind(docs, "DaemonSet"):
            continue
        pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
        sc = container(docs)["securityContext"]
        # The container runs as root only to use the kubelet's socket (tested above).
        assert sc.get("runAsUser", 0) == 0 and sc.get("runAsNonRoot") is not None, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == 10001, name  # the Dockerfile's USER
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        # Only the pod reader and the admin identities talk to the Kubernetes API.
        readers = ("pod-reader", "claim-reader", "secured")
        assert pod["automountServiceAccountToken"] is (name in readers), name
        assert sc["readOnlyRootFilesystem"] is True, name
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["capabilities"] == {"drop": ["ALL"]}, name
        assert "privileged" not in sc, name
        assert not pod.get("hostNetwork"), name


def test_host_pid_opt_in(rendered: dict[str, list[dict[str, Any]]]) -> None:
    pod = one(rendered["host-pid"], "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert "hostPID is off" in render_notes()
    assert "hostPID is off" not in render_notes(VALUE_SETS["host-pid"])


def test_custom_scheduling(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["custom-scheduling"]
    wanted = VALUE_SETS["custom-scheduling"]["daemonset"]
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["tolerations"] == wanted["tolerations"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert pod["affinity"] == wanted["affinity"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert "runtimeClassName" not in pod
    env = env_of(docs)
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert "NVIDIA_DRIVER_CAPABILITIES" not in env
    assert env["GPUMEM_LABELS"] == "cluster_zone=eu-west-4a,tier=prod"
    assert env["GPUMEM_EXTRA"] == "1"
    assert container(docs)["args"][-2:] == ["--log-level", "debug"]
    assert container(docs)["resources"] == wanted["resources"]
    pod_meta = one(docs, "DaemonSet")["spec"]["template"]["metadata"]
    assert pod_meta["annotations"]["example.com/team"] == "ml-platform"


def test_admin_token_from_existing_secret(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["existing-secret"]
    assert not by_kind(docs, "Secret")
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "admin-token")
    assert volume["secret"]["secretName"] == "gpumem-admin"
    assert volume["secret"]["items"] == [{"key": "bearer", "path": "bearer"}]
    mount = next(m for m in container(docs)["volumeMounts"] if m["name"] == "admin-token")
    assert mount["readOnly"] is True
    assert env_of(docs)["GPUMEM_ADMIN_TOKEN_FILE"] == f"{mount['mountPath']}/bearer"
    assert "GPUMEM_ADMIN_TOKEN" not in env_of(docs), "the token itself never goes in env"


def test_admin_token_from_chart_secret(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["chart-secret"]
    secret = one(docs, "Secret")
    assert base64.b64decode(secret["data"]["token"]).decode() == "not-a-real-token"
    pod_spec = one(docs, "DaemonSet")["spec"]["template"]
    volume = next(v for v in pod_spec["spec"]["volumes"] if v["name"] == "admin-token")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert env_of(docs)["GPUMEM_ADMIN_TOKEN_FILE"] == "/etc/gpumem-exporter/admin/token"
    # A changed token rolls the pods.
    assert "checksum/admin-token" in pod_spec["metadata"]["annotations"]
    assert "not-a-real-token" not in json.dumps(pod_spec)


def test_service_and_service_monitor(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    service = one(docs, "Service")
    daemonset = one(docs, "DaemonSet")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert all(pod_labels[k] == v for k, v in service["spec"]["selector"].items())
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    monitor = one(docs, "ServiceMonitor")
    assert all(
        service["metadata"]["labels"][k] == v
        for k, v in monitor["spec"]["selector"]["matchLabels"].items()
    )
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["relabelings"][0]["targetLabel"] == "node"
    # GpuMemExporterDown selects scrape jobs by name: up{job=~".*gpumem.*"}.
    assert "gpumem" in service["metadata"]["name"]

    off = rendered["service-monitor-off"]
    assert not by_kind(off, "ServiceMonitor")
    assert by_kind(off, "Service") and by_kind(off, "DaemonSet")


def test_pod_monitor(rendered: dict[str, list[dict[str, Any]]]) -> None:
    default = one(rendered["defaults"], "PodMonitor")
    assert default["spec"]["selector"] == {"matchLabels": {"gpumem-exporter/scrape": "true"}}
    assert default["spec"]["namespaceSelector"] == {"any": True}
    assert default["spec"]["podMetricsEndpoints"][0]["port"] == "gpumem-metrics"
    assert "gpumem" in default["metadata"]["name"]

    wanted = VALUE_SETS["custom-pod-monitor"]["podMonitor"]
    custom = one(rendered["custom-pod-monitor"], "PodMonitor")
    assert custom["metadata"]["namespace"] == "observability"
    assert custom["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert custom["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/component": "inference"},
        "matchExpressions": wanted["selector"]["matchExpressions"],
    }
    assert custom["spec"]["namespaceSelector"] == wanted["namespaceSelector"]
    assert custom["spec"]["podTargetLabels"] == ["model"]
    endpoint = custom["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics"
    assert endpoint["interval"] == "30s"
    assert endpoint["relabelings"][1:] == wanted["relabelings"]
    assert endpoint["metricRelabelings"] == wanted["metricRelabelings"]


def test_pod_monitor_namespace_selector() -> None:
    # matchNames wins over the default any: true (Helm merges the two maps).
    spec = one(render({"podMonitor": {"namespaceSelector": {"matchNames": ["a"]}}}), "PodMonitor")
    assert spec["spec"]["namespaceSelector"] == {"matchNames": ["a"]}
    # Neither: the operator's default, the PodMonitor's own namespace.
    spec = one(render({"podMonitor": {"namespaceSelector": {"any": False}}}), "PodMonitor")
    assert "namespaceSelector" not in spec["spec"]


def test_node_daemon_off(rendered: dict[str, list[dict[str, Any]]]) -> None:
    kinds = sorted(doc["kind"] for doc in rendered["node-daemon-off"])
    assert kinds == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    kinds = sorted(doc["kind"] for doc in rendered["only-node-daemon"])
    assert kinds == ["DaemonSet", "Service", "ServiceAccount", "ServiceMonitor"]


def test_overrides(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["overrides"]
    assert container(docs)["image"] == "registry.example.com/gpumem-exporter@sha256:" + "a" * 64
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpumem-reader"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert not by_kind(docs, "ServiceAccount")
    assert "clusterIP" not in one(docs, "Service")["spec"]
    assert one(docs, "ServiceMonitor")["metadata"]["namespace"] == "observability"
    dashboards = one(docs, "ConfigMap")["metadata"]
    assert dashboards["namespace"] == "grafana"
    assert dashboards["annotations"] == {"grafana_folder": "GPU"}
    for doc in docs:
        assert doc["metadata"]["name"].startswith("gpumem")
        assert doc["metadata"]["labels"]["team"] == "ml-platform"


# --- rules and dashboards come from their single sources ---------------------------------------


def test_rules_and_dashboards_are_links_to_the_single_sources() -> None:
    assert (CHART / "rules").is_symlink()
    assert (CHART / "rules").resolve() == RULES_DIR.resolve()
    assert (CHART / "dashboards").is_symlink()
    assert (CHART / "dashboards").resolve() == DASHBOARDS_DIR.resolve()


def source_rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    for path in sorted(RULES_DIR.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict):
            groups.extend(doc.get("groups") or [])
    return groups


def test_prometheus_rule_is_deploy_prometheus(rendered: dict[str, list[dict[str, Any]]]) -> None:
    groups = source_rule_groups()
    assert groups, "deploy/prometheus/*.yaml holds no rule groups"
    rule = one(rendered["defaults"], "PrometheusRule")
    assert rule["spec"]["groups"] == groups
    # Read as files, not rendered as templates: alert templating survives untouched.
    text = json.dumps(rule)
    sources = "".join(p.read_text() for p in RULES_DIR.glob("*.yaml"))
    if "{{ $labels" in sources:
        assert "{{ $labels" in text


@pytest.mark.parametrize(
    ("tiers", "files"),
    [
        (["node"], ["alerts.yaml", "recording.yaml"]),
        (["global"], ["recording-global.yaml"]),
        (["global", "node"], ["alerts.yaml", "recording-global.yaml", "recording.yaml"]),
    ],
)
def test_prometheus_rule_installs_the_tiers_asked_for(tiers: list[str], files: list[str]) -> None:
    """A shard of a fleet sharded by node takes the node tier, the global ruler the global
    tier; a file named *-global.yaml is the global tier."""
    expected = [
        group
        for name in files
        for group in yaml.safe_load((RULES_DIR / name).read_text())["groups"]
    ]
    rule = one(render({"prometheusRule": {"enabled": True, "tiers": tiers}}), "PrometheusRule")
    assert rule["spec"]["groups"] == expected


def test_prometheus_rule_refuses_no_tier_and_an_unknown_tier() -> None:
    with pytest.raises(Exception, match="tiers is empty"):
        render({"prometheusRule": {"enabled": True, "tiers": []}})
    with pytest.raises(Exception, match="tiers"):
        render({"prometheusRule": {"enabled": True, "tiers": ["shard"]}})


def test_prometheus_rule_without_runbook_url_base(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    # No base, no link: the alerts keep the runbook annotation naming their section.
    annotations = [
        rule["annotations"]
        for group in one(rendered["defaults"], "PrometheusRule")["spec"]["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]
    assert annotations
    for annotation in annotations:
        assert "runbook_url" not in annotation
        assert annotation["runbook"].startswith("docs/runbooks.md#")


def test_prometheus_rule_runbook_urls(rendered: dict[str, list[dict[str, Any]]]) -> None:
    expected = copy.deepcopy(source_rule_groups())
    for group in expected:
        for rule in group["rules"]:
            if "alert" in rule:
                section = rule["annotations"].pop("runbook").removeprefix("docs/runbooks.md")
                rule["annotations"]["runbook_url"] = RUNBOOK_URL_BASE + section
    rule = one(rendered["kube-prometheus-stack"], "PrometheusRule")
    assert rule["spec"]["groups"] == expected
    urls = [r["annotations"]["runbook_url"] for g in expected for r in g["rules"] if "alert" in r]
    assert RUNBOOK_URL_BASE + "#gpumemoutofmemory" in urls


def test_runbook_annotation_is_required_with_a_base(tmp_path: Path) -> None:
    """A rule file whose alert names no runbook section fails the render, not silently."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart, symlinks=False, ignore=shutil.ignore_patterns("dashboards"))
    alerts = chart / "rules" / "alerts.yaml"
    alerts.write_text(
        alerts.read_text().replace(
            "runbook: docs/runbooks.md#gpumemoutofmemory", "runbook: see the wiki"
        )
    )
    with (
        helm.Chart.load(chart) as loaded,
        pytest.raises(helm.HelmRenderError, match="GpuMemOutOfMemory"),
    ):
        loaded.render(
            {"runbookUrlBase": RUNBOOK_URL_BASE, "dashboards": {"enabled": False}},
            name=RELEASE,
            namespace=NAMESPACE,
        )


def test_monitoring_object_labels(rendered: dict[str, list[dict[str, Any]]]) -> None:
    chart_labels = one(rendered["defaults"], "DaemonSet")["metadata"]["labels"]
    chart_labels = {k: v for k, v in chart_labels.items() if k != "app.kubernetes.io/component"}
    for kind in MONITORING_KINDS:
        labels = one(rendered["defaults"], kind)["metadata"]["labels"]
        assert "release" not in labels, kind  # empty kubePrometheusStackRelease: no label
        assert chart_labels.items() <= labels.items(), kind
    docs = rendered["kube-prometheus-stack"]
    # One value for all three objects, merged with the chart's labels and additionalLabels;
    # an object's own additionalLabels win.
    service_monitor = one(docs, "ServiceMonitor")["metadata"]["labels"]
    pod_monitor = one(docs, "PodMonitor")["metadata"]["labels"]
    rule = one(docs, "PrometheusRule")["metadata"]["labels"]
    assert service_monitor["release"] == "mine"
    assert service_monitor["team"] == "ml-platform"
    assert service_monitor["app.kubernetes.io/component"] == "node-daemon"
    assert pod_monitor["release"] == "kps" and pod_monitor["prometheus"] == "gpu"
    assert pod_monitor["app.kubernetes.io/component"] == "inference-pods"
    assert rule["release"] == "kps" and rule["role"] == "alert-rules"
    for labels in (service_monitor, pod_monitor, rule):
        assert chart_labels.items() <= labels.items()


def test_prometheus_rule_additional_alert_labels(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    expected = copy.deepcopy(source_rule_groups())
    for group in expected:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["labels"] = {"team": "ml-platform", **(rule.get("labels") or {})}
    rule = one(rendered["overrides"], "PrometheusRule")
    assert rule["spec"]["groups"] == expected
    assert rule["metadata"]["labels"]["release"] == "kps"


def sidecar_copy(path: Path, runbook_url_base: str = "") -> dict[str, Any]:
    """The dashboard file as the chart must ship it to Grafana's sidecar, which imports nothing:
    the data source variable on Grafana's default instead of the import input, and the runbook
    base, when set."""
    dashboard = json.loads(path.read_text())
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "datasource":
            variable["current"] = {"selected": True, "text": "default", "value": "default"}
        elif variable["name"] == "runbook_url_base" and runbook_url_base:
            option = {"text": runbook_url_base, "value": runbook_url_base}
            variable["query"] = runbook_url_base
            variable["current"] = {"selected": False, **option}
            variable["options"] = [{"selected": True, **option}]
    return dashboard


@pytest.mark.parametrize(
    ("name", "runbook_url_base"), [("defaults", ""), ("kube-prometheus-stack", RUNBOOK_URL_BASE)]
)
def test_dashboards_config_map(
    rendered: dict[str, list[dict[str, Any]]], name: str, runbook_url_base: str
) -> None:
    config_map = one(rendered[name], "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p for p in DASHBOARDS_DIR.glob("*.json")}
    assert {"gpumem-pod.json", "gpumem-fleet.json"} <= set(files)
    assert set(config_map["data"]) == set(files)
    for file, path in files.items():
        shipped = json.loads(config_map["data"][file])
        assert shipped == sidecar_copy(path, runbook_url_base), file
        # Nothing is left for an import to fill in; panels still go through the variable.
        assert "${DS_PROMETHEUS}" not in config_map["data"][file]
        assert "${datasource}" in config_map["data"][file]
    # Grafana's sidecar and the API server's 1 MiB object limit.
    assert len(json.dumps(config_map)) < 900_000


def test_packaged_chart_carries_rules_and_dashboards(tmp_path: Path) -> None:
    """`helm package` follows the symlinks, so the archive is complete on its own."""
    archive = helm.package(CHART, destination=tmp_path)
    with helm.Chart.load_archive(Path(archive).read_bytes()) as chart:
        names = {f["name"] for f in chart.files}
        manifests = chart.render(None, name=RELEASE, namespace=NAMESPACE)
    assert {"rules/alerts.yaml", "dashboards/gpumem-pod.json"} <= names
    assert "PrometheusRule" in "".join(manifests.values())


# --- the documented install works ------------------------------------------------------------

INSTALL_DOCS = [REPO_ROOT / "README.md", REPO_ROOT / "docs" / "deploy.md", CHART / "README.md"]


def documented_commands(markdown: str, *prefixes: str) -> list[list[str]]:
    """The commands of the ```sh blocks that start with one of PREFIXES, as the shell splits
    them (continuation lines joined)."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", markdown, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith(prefixes):
                commands.append(shlex.split(line, comments=True))
    return commands


def set_values(command: list[str]) -> dict[str, Any]:
    """The values of `helm install ... --set a.b=c ...` (every value here is a string)."""
    values: dict[str, Any] = {}
    for flag, arg in itertools.pairwise(command):
        if flag != "--set":
            continue
        key, _, value = arg.partition("=")
        *parents, leaf = key.split(".")
        node = values
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return values


@pytest.mark.parametrize("doc", INSTALL_DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_documented_install_builds_pushes_and_uses_the_image(doc: Path) -> None:
    """No image is published: each doc builds and pushes one, and its `helm install` (whose
    values must pass the schema and render) makes the nodes pull exactly that image."""
    text = doc.read_text()
    installs = documented_commands(text, "helm install")
    assert installs, f"{doc.name}: no helm install"
    built = {c[c.index("-t") + 1] for c in documented_commands(text, "docker build")}
    pushed = {c[2] for c in documented_commands(text, "docker push")}
    for install in installs:
        values = set_values(install)
        assert values.get("image", {}).get("repository"), "the install must set image.repository"
        image = container(render(values))["image"]
        assert image in built, f"{doc.name}: {image} is never built"
        assert image in pushed, f"{doc.name}: {image} is never pushed"


# --- the endpoint secured (web config, TLS, identities) ----------------------------------


def _web_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    secret = next(
        d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("web-config")
    )
    config: dict[str, Any] = yaml.safe_load(secret["stringData"]["web.yml"])
    return config


def test_secured_release_renders_a_web_config_the_exporter_loads(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    from exporter.webconfig.file import load_web_config

    docs = rendered["secured"]
    config = _web_config(docs)
    tls = config["tls_server_config"]
    assert tls["client_auth_type"] == "RequireAndVerifyClientCert"
    assert tls["client_allowed_sans"] == ["prometheus"]
    assert config["basic_auth_users"] == {"prometheus": BCRYPT}
    # Same keys and meanings as the exporter reads them (files checked where they are mounted).
    (tmp_path / "web.yml").write_text(yaml.safe_dump(config))
    loaded = load_web_config(tmp_path / "web.yml")
    assert loaded.tls is not None and loaded.tls.client_ca_file == tls["client_ca_file"]
    # The files it names are where the pod mounts them.
    mounts = {m["name"]: m["mountPath"] for m in container(docs)["volumeMounts"]}
    assert tls["cert_file"] == mounts["tls"] + "/tls.crt"
    assert tls["client_ca_file"] == mounts["client-ca"] + "/ca.crt"
    env = env_of(docs)
    assert env["GPUMEM_WEB_CONFIG_FILE"] == mounts["web-config"] + "/web.yml"
    volumes = {v["name"]: v for v in one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "gm-gpumem-exporter-tls"
    assert all(
        volumes[n]["secret"]["defaultMode"] == 0o440 for n in ("tls", "client-ca", "web-config")
    )


def test_secured_release_probes_and_monitors_follow_tls(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    secured, tls_only = container(rendered["secured"]), container(rendered["tls-existing-secret"])
    # Kubelet probes have no client certificate: where one is required they ask the health
    # port (plain HTTP, /healthz and /readyz only), else the main port over HTTPS.
    ports = {p["name"]: p["containerPort"] for p in secured["ports"]}
    assert env_of(rendered["secured"])["GPUMEM_HEALTH_PORT"] == str(ports["health"])
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert secured[probe]["httpGet"] == {"path": path, "port": "health", "scheme": "HTTP"}
    assert "GPUMEM_HEALTH_PORT" not in env_of(rendered["tls-existing-secret"])
    assert tls_only["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert tls_only["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    endpoint = one(rendered["tls-existing-secret"], "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "exporter-tls", "key": "ca.crt"}},
        "serverName": "gm-gpumem-exporter.monitoring.svc",
    }
    endpoint = one(rendered["secured"], "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["basicAuth"]["password"] == {"name": "scrape-auth", "key": "password"}
    assert endpoint["tlsConfig"]["keySecret"] == {"name": "prometheus-client", "key": "tls.key"}
    pod_endpoint = one(rendered["secured"], "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert pod_endpoint["scheme"] == "https"
    certificate = one(rendered["secured"], "Certificate")
    assert certificate["spec"]["dnsNames"][0] == "gm-gpumem-exporter.monitoring.svc"
    assert certificate["spec"]["issuerRef"]["name"] == "cluster-ca"


def test_kubernetes_admin_identities_get_review_rights_and_on_call_roles(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["secured"]
    env = env_of(docs)
    assert env["GPUMEM_ADMIN_AUTH"] == "kubernetes"
    assert env["GPUMEM_ADMIN_KUBERNETES_AUTHORIZATION"] == "namespace"
    binding = next(
        d
        for d in by_kind(docs, "ClusterRoleBinding")
        if d["roleRef"]["name"] == "system:auth-delegator"
    )
    assert binding["subjects"][0]["name"] == "gm-gpumem-exporter"
    roles = {d["metadata"]["name"]: d["rules"] for d in by_kind(docs, "ClusterRole")}
    from exporter.kubernetes.identities import GROUP, RESOURCES

    admin = roles["gm-gpumem-exporter-admin"][0]
    assert admin["apiGroups"] == [GROUP] and set(admin["resources"]) == set(RESOURCES.values())
    assert "create" not in roles["gm-gpumem-exporter-viewer"][0]["verbs"]
    notes = render_notes(SECURED)
    assert "--clusterrole=gm-gpumem-exporter-admin" in notes and "--kubeconfig-token" in notes
    # Nothing of it without the setting.
    assert "GPUMEM_ADMIN_AUTH" not in env_of(rendered["defaults"])
    assert not by_kind(rendered["defaults"], "Certificate")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"web": {"tls": {"enabled": True}}},
            "needs web.tls.existingSecret or web.tls.certManager",
        ),
        (
            {
                "web": {
                    "tls": {
                        "enabled": True,
                        "existingSecret": "s",
                        "clientAuthType": "RequireAndVerifyClientCert",
                    }
                }
            },
            "needs web.tls.clientCA.existingSecret",
        ),
        ({"web": {"basicAuth": {"users": {"p": BCRYPT}}}}, "needs serviceMonitor.basicAuth"),
        (
            {
                "web": {"existingConfigSecret": "mine", "basicAuth": {"users": {"p": BCRYPT}}},
                "serviceMonitor": {"basicAuth": {"username": {"name": "a", "key": "u"}}},
            },
            "put the users in your Secret's web.yml",
        ),
        (
            {"web": {"tls": {"enabled": True, "certManager": {"enabled": True}}}},
            "needs web.tls.certManager.issuerRef.name",
        ),
        # Client certificates required and none for Prometheus: it would be refused.
        ({"web": REQUIRED_CLIENT_CERT}, "needs serviceMonitor.clientCertificate.existingSecret"),
        (
            {
                "web": REQUIRED_CLIENT_CERT,
                "serviceMonitor": {"tlsConfig": {"ca": {"secret": {"name": "s", "key": "ca"}}}},
            },
            "serviceMonitor.tlsConfig needs cert and keySecret",
        ),
    ],
)
def test_incomplete_security_values_fail_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(values)


def test_a_web_config_of_your_own_keeps_users_out_of_the_release() -> None:
    auth = SECURED["serviceMonitor"]["basicAuth"]
    docs = render(
        {
            "web": {"existingConfigSecret": "my-web-config", "basicAuth": {"enabled": True}},
            "serviceMonitor": {"basicAuth": auth},
        }
    )
    assert not [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("web-config")]
    volumes = {v["name"]: v for v in one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["web-config"]["secret"]["secretName"] == "my-web-config"
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["basicAuth"] == auth


def test_a_password_instead_of_a_bcrypt_hash_is_refused_by_the_schema() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError):
        chart.validate_schema({"web": {"basicAuth": {"users": {"prometheus": "hunter2"}}}})


@pytest.mark.parametrize("name", VALUE_SETS)
def test_notes_have_no_stray_whitespace(name: str) -> None:
    """NOTES.txt as `helm install` prints it: no trailing spaces, no run of blank lines."""
    notes = render_notes(VALUE_SETS[name])
    assert [line for line in notes.splitlines() if line != line.rstrip()] == []
    assert "\n\n\n" not in notes


def test_required_client_certificates_make_prometheus_present_one() -> None:
    """docs/deploy.md's mTLS set-up without a tlsConfig of one's own: the ServiceMonitor
    presents serviceMonitor.clientCertificate (it once rendered none, and Prometheus was
    refused with "certificate required"); NOTES' curl presents one too."""
    values = {
        "web": REQUIRED_CLIENT_CERT,
        "serviceMonitor": {"clientCertificate": {"existingSecret": "prometheus-client"}},
    }
    endpoint = one(render(values), "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "exporter-tls", "key": "ca.crt"}},
        "serverName": "gm-gpumem-exporter.monitoring.svc",
        "cert": {"secret": {"name": "prometheus-client", "key": "tls.crt"}},
        "keySecret": {"name": "prometheus-client", "key": "tls.key"},
    }
    notes = render_notes(values)
    assert "--cert client.crt --key client.key" in notes and "required" in notes
    # Asked for but not required: presented when given, not demanded.
    optional = {"tls": {**REQUIRED_CLIENT_CERT["tls"], "clientAuthType": "VerifyClientCertIfGiven"}}
    endpoint = one(render({"web": optional}), "ServiceMonitor")["spec"]["endpoints"][0]
    assert "cert" not in endpoint["tlsConfig"]
