"""exporter.kubernetes.cgroup on one real /proc/<pid>/cgroup per path shape
(tests/data/cgroup/SOURCES.md says where each comes from)."""

from __future__ import annotations

import pytest

from exporter.kubernetes.cgroup import Container, UnknownCgroupShape, parse_cgroup, read_cgroup
from tests.conftest import DATA_DIR

CGROUPS = DATA_DIR / "cgroup"
CRIO_ID = "a09343ca97901516c25036e2b954421254f8c68b384b536064e8999f0c4ed18d"
EXPECTED = {
    "v2-systemd-crio.txt": Container("2c9f8a79-5391-454b-88cb-86190881cb96", CRIO_ID, "cri-o"),
    "v2-systemd-crio-guaranteed.txt": Container(
        "7922aa99-d4aa-4885-a953-82976860b23a",
        "1c33afbc9e5aa6c69150d1af05254b562a4b17c313fc6153e3625cf456922bfe",
        "cri-o",
    ),
    "v2-systemd-containerd-kind.txt": Container(
        "3cae2e45-052c-4b11-80d3-4d7b2d2d3464",
        "2b180104511194aab36fd295d3e217439f3ddb5bc88277f37b4952abee85c40e",
        "containerd",
    ),
    "v2-nested-kind-in-docker.txt": Container(
        "eab5a334-93fe-48a8-b139-9e8079c1f163",
        "99f3a16ea25b7724cb56a4f0c0df1113ad9474fbf5545bead97fd5c7f61c13f4",
        "containerd",
    ),
    # Issue 38: the deepest pod UID used to win, so a container could claim another pod.
    "hostile-nested-in-container.txt": Container(
        "2c9f8a79-5391-454b-88cb-86190881cb96", CRIO_ID, "cri-o"
    ),
    "hostile-nested-in-pod.txt": Container("2c9f8a79-5391-454b-88cb-86190881cb96", "", ""),
    "v2-nested-kind-pod-level.txt": Container("eab5a334-93fe-48a8-b139-9e8079c1f163", "", ""),
    "v2-cgroupfs-burstable.txt": Container(
        "5a89bcaa-3509-4375-83e1-b9e7a5712123",
        "a069581483b00a498b3ba172612ffed06b3275a043bf3895c1b19e783e2793ee",
        "",
    ),
    "v2-cgroupfs-guaranteed.txt": Container(
        "51b64565-2b17-4d46-83ac-22e398f2f7fb",
        "65d752a38e1db784d521f48c3f1956f4f9a74ebb923377144f253f3aca9fa028",
        "",
    ),
    "v2-private-namespace.txt": Container(
        "2c9f8a79-5391-454b-88cb-86190881cb96", CRIO_ID, "containerd"
    ),
    "v2-pod-level.txt": Container("a9c80282-3f6b-4d5b-84d5-a137a6668011", "", ""),
    "v1-cgroupfs-besteffort.txt": Container(
        "bdd4097d-6795-404e-9bd8-6a1383386198",
        "c79788e0da15a6597263eb2b9c51d05dd1a9a1d08c53c1161dc8c45d2dac6b38",
        "",
    ),
    "v1-systemd-containerd.txt": Container(
        "0043435f-1854-4327-b76b-730f681a781d",
        "01fd96f7ad292b02a8317cde4ecb8c7ef3cc06ffdd113f13410e0837eb2b2a20",
        "containerd",
    ),
    "v1-systemd-crio.txt": Container(
        "d0511cd2-29d2-4215-be0f-f77bc0609d99",
        "f93ee491b8ed2680d5a909eb098b14a9430173b57ca1c4efedd8768566d67e8e",
        "cri-o",
    ),
    "docker-systemd.txt": Container(
        "", "b176419186d75a44628851daf7841d3374a2ec56d0b038ee3bd1e0c6d331e5b1", "docker"
    ),
    "docker-cgroupfs-v1.txt": Container(
        "", "ce82d94d69e1fbbc7feeb66930c69e9b96d9f151f594773e5d0e342741d15437", "docker"
    ),
    "podman-rootless.txt": Container(
        "", "f992ec4ed807f76e5e54c9c67d78f0a4105bf945420271c2558ba905e38d2108", "libpod"
    ),
    "host-user-session.txt": None,
    "host-service.txt": None,
}


def test_every_fixture_has_an_expectation():
    files = {p.name for p in CGROUPS.glob("*.txt")} - {"unknown-kubepods.txt"}
    assert files == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_shape(name):
    assert parse_cgroup((CGROUPS / name).read_text()) == EXPECTED[name]


def test_a_kubepods_path_of_unknown_shape_is_refused_not_guessed():
    with pytest.raises(UnknownCgroupShape, match="kubepods"):
        parse_cgroup((CGROUPS / "unknown-kubepods.txt").read_text())


@pytest.mark.parametrize("text", ["", "garbage\n", "x:y\n"])
def test_garbage_is_an_unknown_shape(text):
    with pytest.raises(UnknownCgroupShape):
        parse_cgroup(text)


def test_read_cgroup_of_a_live_process_and_of_a_gone_one(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_bytes((CGROUPS / "v2-systemd-crio.txt").read_bytes())
    assert read_cgroup(42, str(tmp_path)) == EXPECTED["v2-systemd-crio.txt"]
    with pytest.raises(FileNotFoundError):
        read_cgroup(43, str(tmp_path))


def test_this_machines_own_processes_parse():
    """Whatever this machine runs in, its own cgroup file is of a known shape."""
    read_cgroup(1)
