"""exporter.kubernetes.container_logs: the kubelet's links in /var/log/containers, made here as
the kubelet makes them (real symlinks in a folder of the test's)."""

from __future__ import annotations

import os

import pytest

from exporter.kubernetes import container_logs
from exporter.kubernetes.container_logs import ContainerLogsError, read_container_logs
from tests.support.kubelet_standin import link_container_log

UID_A = "2c9f8a79-5391-454b-88cb-86190881cb96"
UID_B = "7922aa99-d4aa-4885-a953-82976860b23a"
ID_A, ID_B, ID_C = "a" * 64, "b" * 64, "c" * 64


def test_pods_and_containers_are_named_from_the_links(tmp_path):
    link_container_log(tmp_path, "serving", "llama-0", UID_A, "server", ID_A)
    link_container_log(tmp_path, "serving", "llama-0", UID_A, "log-shipper", ID_B)
    link_container_log(tmp_path, "ml", "my-notebook-3", UID_B, "jupyter-lab", ID_C)
    names = read_container_logs(str(tmp_path))
    assert names.pods == {UID_A: ("serving", "llama-0"), UID_B: ("ml", "my-notebook-3")}
    assert names.containers == {ID_A: "server", ID_B: "log-shipper", ID_C: "jupyter-lab"}


def test_a_name_the_kubelet_cut_at_255_characters_still_names_the_pod(tmp_path):
    """The kubelet cuts a link's name to 255 characters (ext4): a long pod name loses the
    container ID's tail. The pod is named from the link's target; its container ID is not
    guessed from what is left."""
    pod = "p" * 200
    target = f"/var/log/pods/serving_{pod}_{UID_A}/server/0.log"
    cut = f"{pod}_serving_server-{ID_A}"[:251] + ".log"
    (tmp_path / cut).symlink_to(target)
    names = read_container_logs(str(tmp_path))
    assert names.pods == {UID_A: ("serving", pod)}
    assert names.containers == {}


LINK = f"llama-0_serving_server-{ID_A}.log"
POD_LOGS = "/var/log/pods"


@pytest.mark.parametrize(
    ("name", "target"),
    [
        # A collector's own file, and a plain file of the kubelet's shape: no link.
        ("fluent-bit.db", None),
        (LINK, None),
        # Name and target disagree: not what the kubelet makes.
        (LINK, f"{POD_LOGS}/batch_llama-0_{UID_A}/server/0.log"),
        (LINK, f"{POD_LOGS}/serving_llama-0_{UID_A}/other/0.log"),
        # A target that names no pod folder.
        (LINK, f"{POD_LOGS}/serving_llama-0_not-a-uid/server/0.log"),
        (LINK, "0.log"),
    ],
)  # fmt: skip
def test_entries_of_other_shapes_are_skipped(tmp_path, name, target):
    if target is None:
        (tmp_path / name).write_text("")
    else:
        (tmp_path / name).symlink_to(target)
    link_container_log(tmp_path, "ml", "nb", UID_B, "jupyter", ID_C)
    names = read_container_logs(str(tmp_path))
    assert names.pods == {UID_B: ("ml", "nb")}
    assert names.containers == {ID_C: "jupyter"}


def test_a_missing_or_unlistable_folder_is_one_line(tmp_path):
    with pytest.raises(ContainerLogsError, match="No such file or directory"):
        read_container_logs(str(tmp_path / "absent"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ContainerLogsError, match="Not a directory"):
        read_container_logs(str(tmp_path / "file"))


def test_a_folder_of_more_entries_than_any_node_has_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(container_logs, "MAX_LINKS", 5)
    for n in range(6):
        link_container_log(tmp_path, "ml", f"nb-{n}", UID_B, "jupyter", f"{n:064x}")
    with pytest.raises(ContainerLogsError, match="over 5 entries"):
        read_container_logs(str(tmp_path))


def test_nothing_a_link_points_to_is_opened(tmp_path):
    """A link whose target is a FIFO (or anything at all) is only read as a name."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    pods = tmp_path / "pods" / f"serving_llama-0_{UID_A}" / "server"
    pods.mkdir(parents=True)
    os.mkfifo(pods / "0.log")
    links = tmp_path / "containers"
    links.mkdir()
    (links / f"llama-0_serving_server-{ID_A}.log").symlink_to(pods / "0.log")
    names = read_container_logs(str(links))  # returns: no open() of the FIFO
    assert names.pods == {UID_A: ("serving", "llama-0")}
