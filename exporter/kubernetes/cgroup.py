"""Which pod and container a process is in, from /proc/<pid>/cgroup.

Shapes handled (tests/data/cgroup/ has one file per shape, with where each comes from):
- cgroup v2: one line `0::<path>`; v1: one line per hierarchy `<n>:<controllers>:<path>`.
- systemd driver: `.../kubepods-<qos>-pod<uid with underscores>.slice/<runtime>-<id>.scope`
  with `cri-containerd-`, `crio-` or `docker-`; v1 with containerd's systemd cgroup paths:
  `...pod<uid>.slice:cri-containerd:<id>`.
- cgroupfs driver: `/kubepods/<qos>/pod<uid with dashes>/<id>` (Guaranteed pods: no <qos>).
- Docker and Podman outside Kubernetes: `/docker/<id>`, `docker-<id>.scope`, `libpod-<id>.scope`.
- A private cgroup namespace shows other cgroups as `/../../<path>`: nothing is anchored at
  the start. Nested clusters (kind) hold several IDs: the container is the first inside the
  pod. Of several pod UIDs the outermost is the process's (the kubelet's cgroup; one nested
  under a container is the container's own making): a node daemon runs on the outer node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?(?=[/:]|$)"
)
# A 64-hex container ID as a path element, a systemd scope, or after a v1 `:runtime:`.
_CONTAINER = re.compile(
    r"(?:^|/|:)(?:(cri-containerd|crio|docker|libpod|containerd)[-:/])?([0-9a-f]{64})(?:\.scope)?(?=/|$)"
)
_RUNTIMES = {"cri-containerd": "containerd", "containerd": "containerd", "crio": "cri-o"}


class UnknownCgroupShape(ValueError):
    """The cgroup says Kubernetes but in a shape this module does not know."""


@dataclass(frozen=True)
class Container:
    """Where a process runs: pod_uid is "" for a container of no pod (docker run)."""

    pod_uid: str
    container_id: str
    runtime: str


def cgroup_paths(text: str) -> list[str]:
    """The paths of a /proc/<pid>/cgroup file, v2's unified line first."""
    paths: list[str] = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or not hierarchy.isdigit():
            continue
        if hierarchy == "0" and not controllers:
            paths.insert(0, path)
        else:
            paths.append(path)
    return paths


def parse_cgroup(text: str) -> Container | None:
    """The container a process is in, or None for a process in no container (a host service,
    a login session). UnknownCgroupShape for a Kubernetes path it cannot read."""
    paths = cgroup_paths(text)
    if not paths:
        raise UnknownCgroupShape("no cgroup line")
    found = [c for c in (_parse_path(p) for p in paths) if c is not None]
    # A pod's container first, then any container; v1 hierarchies agree where both are set.
    for container in sorted(found, key=lambda c: (not c.pod_uid, not c.container_id)):
        return container
    if any("kubepods" in p for p in paths):
        raise UnknownCgroupShape(f"unrecognised kubepods path {paths[0][:200]!r}")
    return None


def _parse_path(path: str) -> Container | None:
    pods = list(_POD_UID.finditer(path))
    containers = list(_CONTAINER.finditer(path))
    if not pods:
        if not containers:
            return None
        runtime, container_id = containers[-1].groups()  # Docker in Docker: the innermost
        return Container("", container_id, _RUNTIMES.get(runtime or "", runtime or ""))
    # The outermost pod is the process's: the kubelet made that cgroup. One nested deeper
    # was made inside a container (a privileged or cgroup-writable one) and may name any
    # pod (issue 38). Its container is the first ID between that pod and the next pod
    # UID: never the node's own container outside it (kind), never a nested one.
    pod = pods[0]
    end = pods[1].start() if len(pods) > 1 else len(path)
    inside = [c for c in containers if pod.end() <= c.start() < end]
    runtime, container_id = inside[0].groups() if inside else ("", "")
    runtime = runtime or ""
    return Container(pod.group(1).replace("_", "-"), container_id, _RUNTIMES.get(runtime, runtime))


def read_cgroup(pid: int, proc: str = "/proc") -> Container | None:
    """parse_cgroup of a live process; OSError if it is gone or unreadable."""
    with open(f"{proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
        return parse_cgroup(f.read())
