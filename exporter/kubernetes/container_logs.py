"""The pods and containers of this node as the kubelet names them on its own disk: the links it
makes in /var/log/containers for every container it starts,

    /var/log/containers/<pod>_<namespace>_<container>-<container ID>.log
        -> /var/log/pods/<namespace>_<pod>_<pod UID>/<container>/<restart>.log

(the kubelet's `legacyLogSymlink`, kept for log collectors; the target's folder follows the
kubelet's podLogsDir). Pod and namespace names are DNS labels and subdomains, which hold no
"_", so the names split without doubt.

Why these and not a container's own files: what a container holds (its /etc/hostname, its
service-account namespace file) is its tenant's to write, and a process can chroot into a
folder whose files are FIFOs. The link names are made by the kubelet in a folder of the host's
that no pod writes, and reading them opens no file: one folder listing and one readlink per
link, nothing a tenant can make slow or large. With these names the node daemon names a GPU
process from its cgroup's pod UID and container ID alone, as the pod reader does, without
any access to the Kubernetes API.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

DEFAULT_FOLDER = "/var/log/containers"
# A node runs at most a few hundred pods; past this the folder is not the kubelet's.
MAX_LINKS = 16384

_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
_POD_FOLDER = re.compile(
    r"^([^_/]+)_([^_/]+)_([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$"
)


class ContainerLogsError(RuntimeError):
    """The folder could not be read; str() is one line."""


@dataclass
class KubeletNames:
    """What the kubelet's links say: the shape of exporter.kubernetes.pods.NodePods."""

    pods: dict[str, tuple[str, str]] = field(default_factory=dict)  # uid -> (namespace, name)
    containers: dict[str, str] = field(default_factory=dict)  # container ID -> name


def read_container_logs(folder: str = DEFAULT_FOLDER) -> KubeletNames:
    """The names of the kubelet's links in `folder`; entries of any other shape are skipped
    (a log collector's own files). ContainerLogsError where the folder cannot be listed."""
    names = KubeletNames()
    try:
        with os.scandir(folder) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_LINKS:
                    raise ContainerLogsError(f"{folder} holds over {MAX_LINKS} entries")
                _add(names, folder, entry.name)
    except OSError as exc:
        raise ContainerLogsError(f"{folder}: {exc.strerror or exc}") from None
    return names


def _add(names: KubeletNames, folder: str, link: str) -> None:
    """One link's names. The target names the pod (namespace, name, UID) and the container;
    the link's own name adds the container ID, unless the kubelet cut it at 255 characters
    (a long pod name): then the pod is still named, its container ID is not."""
    if not link.endswith(".log"):
        return
    try:
        target = os.readlink(os.path.join(folder, link))
    except OSError:
        return  # not a link (or gone since the listing): not the kubelet's
    # <podLogsDir>/<namespace>_<pod>_<uid>/<container>/<restart>.log
    parts = target.rstrip("/").split("/")
    if len(parts) < 3:
        return
    in_folder = _POD_FOLDER.match(parts[-3])
    if in_folder is None:
        return
    namespace, pod, uid = in_folder.groups()
    container = parts[-2]
    prefix = f"{pod}_{namespace}_{container}-"
    if not link.startswith(prefix):
        return  # a link the kubelet did not make: its name and target disagree
    names.pods[uid] = (namespace, pod)
    container_id = link[len(prefix) : -len(".log")]
    if _CONTAINER_ID.fullmatch(container_id):  # not where the kubelet cut the name short
        names.containers[container_id] = container
