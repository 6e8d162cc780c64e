"""Checks on a real GPU: every number against an independent reading, and no stray contexts.

Run on the GPU machine: `pytest -m gpu`. Each scenario runs in a fresh process
(tests/gpu_scenarios.py) because allocator settings and CUDA contexts are per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MiB = 1 << 20


def run_scenario(name: str, *args: str, alloc_conf: str = "") -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=alloc_conf)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "gpu_scenarios.py"), name, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_allocated_and_reserved_move_by_the_bytes_allocated():
    r = run_scenario("exact_bytes")
    n = r["n"]
    before, during, after = r["before"]["gauges"], r["during"]["gauges"], r["after"]["gauges"]
    assert during["allocated_bytes"] - before["allocated_bytes"] == n
    assert during["requested_bytes"] - before["requested_bytes"] == n
    assert during["reserved_bytes"] - before["reserved_bytes"] >= n
    assert (during["allocated_bytes"], during["reserved_bytes"]) == tuple(r["truth_during"])
    assert (before["allocated_bytes"], before["reserved_bytes"]) == tuple(r["truth_before"])
    assert after["allocated_bytes"] == before["allocated_bytes"]
    assert after["reserved_bytes"] == during["reserved_bytes"]  # the cache keeps the segment
    assert during["allocated_peak_bytes"] >= during["allocated_bytes"]


def test_non_allocator_bytes_is_nvml_used_minus_reserved():
    r = run_scenario("context_size")
    non_allocator = r["non_allocator"]
    assert list(non_allocator) == ["0"], r
    outside = non_allocator["0"]
    assert outside == r["raw_nvml_used"] - r["torch_reserved"]
    # A CUDA context plus cuBLAS/kernels is hundreds of MB (FACTS.md: ~520-545 MB).
    assert 100 * MiB < outside < 4096 * MiB
    gpu = next(
        g for g in r["sample"]["gpus"] if g["uuid"] == r["sample"]["allocators"][0]["gpu_uuid"]
    )
    assert (
        gpu["total_bytes"] == gpu["used_bytes"] + gpu["free_bytes"] + gpu["driver_reserved_bytes"]
    )


def test_sampling_never_initializes_cuda():
    r = run_scenario("no_init")
    assert r == {"is_initialized": False, "allocators": 0, "gpus": r["gpus"], "pid_on_gpus": []}
    assert r["gpus"] >= 1


def _devices() -> int:
    return torch.cuda.device_count()


@pytest.mark.multigpu
@pytest.mark.skipif(_devices() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("used", ["0", "1"])
def test_no_context_on_a_gpu_the_process_never_used(used):
    r = run_scenario("one_device", used)
    assert r["device_count"] >= 2
    assert r["allocator_devices"] == [int(used)]
    assert r["pid_on_gpus"] == [r["used_uuid"]], r
    assert [i for i, has in enumerate(r["has_context"]) if has] == [int(used)]


def test_native_backend_reports_fragmentation():
    r = run_scenario("backend")
    reading = r["reading"]
    assert r["backend"] == "native" and reading["backend"] == "native"
    assert reading["gauges"]["allocated_bytes"] == r["truth_allocated"]
    assert reading["gauges"]["reserved_bytes"] == r["truth_reserved"]
    assert reading["gauges"]["inactive_split_bytes"] > 0
    assert "torch_cuda_fragmentation_ratio" in r["metric_names"]
    assert "torch_cuda_pool_reserved_bytes" in r["metric_names"]


def test_expandable_segments_leave_fragmentation_undefined():
    r = run_scenario("backend", alloc_conf="expandable_segments:True")
    reading = r["reading"]
    assert reading["expandable_segments"] is True
    assert "inactive_split_bytes" not in reading["gauges"]
    assert "torch_cuda_fragmentation_ratio" not in r["metric_names"]
    assert "torch_cuda_inactive_split_bytes" not in r["metric_names"]
    assert "torch_cuda_cached_free_ratio" in r["metric_names"]
    assert reading["gauges"]["allocated_bytes"] == r["truth_allocated"]


def test_cuda_malloc_async_exports_only_what_it_tracks():
    r = run_scenario("backend", alloc_conf="backend:cudaMallocAsync")
    reading = r["reading"]
    assert r["backend"] == "cudaMallocAsync" == reading["backend"]
    assert set(reading["gauges"]) <= {
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "allocated_peak_bytes",
        "reserved_peak_bytes",
    }
    assert reading["counters"] == {} and reading["pools"] == {}
    assert reading["gauges"]["allocated_bytes"] == r["truth_allocated"] > 0
    assert "torch_cuda_alloc_retries_total" not in r["metric_names"]
    assert "torch_cuda_fragmentation_ratio" not in r["metric_names"]


def test_retries_and_ooms_are_counted():
    r = run_scenario("oom")
    assert r["raised"]
    assert r["after"]["ooms"] == r["before"]["ooms"] + 1 == r["truth"]["num_ooms"]
    assert r["after"]["alloc_retries"] > r["before"]["alloc_retries"]
    assert r["after"]["alloc_retries"] == r["truth"]["num_alloc_retries"]


def test_embedded_http_serves_the_allocator():
    from prometheus_client.parser import text_string_to_metric_families

    r = run_scenario("http")
    assert r["error"] is None and r["health"]["status"] == "ok"
    assert r["initialized_by_start"] is False
    values = {
        (s.name, s.labels.get("device")): s.value
        for f in text_string_to_metric_families(r["metrics"])
        for s in f.samples
    }
    assert values[("torch_cuda_allocated_bytes", "0")] == r["truth_allocated"]
    assert values[("torch_cuda_reserved_bytes", "0")] == r["truth_reserved"]
    assert ("torch_cuda_non_allocator_bytes", "0") in values
    gpu_labels = [
        s.labels
        for f in text_string_to_metric_families(r["metrics"])
        for s in f.samples
        if s.name == "gpu_memory_total_bytes"
    ]
    assert gpu_labels and all("gpu" in lb and "device" not in lb for lb in gpu_labels)


def test_read_cost_is_reported():
    r = run_scenario("read_cost")
    print(json.dumps(r))
    assert r["torch"]["median_us"] > 0 and r["nvml"]["median_us"] > 0


@pytest.mark.parametrize("used", ["0", "1"])
def test_actions_free_the_cache_and_snapshot_without_touching_other_gpus(used):
    if int(used) >= _devices():
        pytest.skip("needs two GPUs")
    r = run_scenario("actions_on_device", used)
    assert r["released"] == r["reserved_before"] - r["reserved_after"] >= 256 * MiB
    assert r["reserved_after_reported"] == r["reserved_after"]
    assert r["snapshot_segments"] >= 1 and r["snapshot_devices"] == [int(used)]
    assert "_pid" in r["snapshot_name"] and r["snapshot_name"].endswith(".pickle")
    assert r["pid_on_gpus"] == [r["used_uuid"]], r
    assert [i for i, has in enumerate(r["has_context"]) if has] == [int(used)]


def test_snapshot_is_refused_clearly_on_cuda_malloc_async():
    r = run_scenario("snapshot_on_async", alloc_conf="backend:cudaMallocAsync")
    assert r["backend"] == "cudaMallocAsync"
    assert "native backend" in r["unavailable"]


def test_detectors_fire_and_remediation_acts(monkeypatch):
    for name in ("FRAGMENTATION_FOR_S", "FRAGMENTATION_MIN_RESERVED_BYTES"):
        monkeypatch.setenv(f"GPUMEM_DETECT_{name}", "0")
    r = run_scenario("remediation")
    assert r["ratio"] > 0.3 and r["fragmentation_firing"], r
    firing = {e["alert"] for e in r["events"] if e["state"] == "firing"}
    assert {"GpuMemFragmentationHigh", "GpuMemAllocRetries", "GpuMemOutOfMemory"} <= firing
    assert r["oom"] and r["ooms"] == 1 and r["retries"] >= 2
    assert r["remediations"].get("empty_cache:ok") == 1, r
    assert r["remediations"].get("snapshot:ok") == 1, r
    assert r["snapshots"] == {"remediation": 1} and len(r["snapshot_files"]) == 1
    assert r["released_total"] > 0


def test_admin_api_on_a_real_allocator():
    r = run_scenario("admin_http")
    assert r["immediate_status"] == 201 and r["immediate_devices"] == [0]
    assert r["immediate_reserved"] == r["truth_reserved"]
    assert r["view_status"] == 200 and not r["view_external"]
    assert r["window_status"] == 202 and r["busy_status"] == 409
    assert r["window_final_status"] == "ready"
    assert r["window_trace_entries"] > 10 and {"alloc", "free_completed"} <= set(
        r["window_actions"]
    )
    assert r["window_frames"] and r["window_view_status"] == 200
    assert r["history_after_window"] is False  # the window stopped what it started
    assert r["empty_cache_status"] == 200
    released = r["empty_cache"]["released_bytes"]
    assert released >= 512 * MiB and r["empty_cache"]["replay"] is False
    assert r["empty_cache"]["reserved_after_bytes"]["0"] == r["reserved_after_empty_cache"]
    assert r["history_on"] == [200, True] and r["history_off"] == [200, False, True]
    status, devices, peak_before, peak_after, current = r["reset_peak"]
    assert status == 200 and devices == [0] and peak_after == current <= peak_before
    assert r["stats_allocators"] == 1


def test_oom_snapshot_survives_the_process_dying(tmp_path):
    import pickle

    env = dict(os.environ, SNAPSHOT_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "gpu_scenarios.py"), "oom_exit"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "OutOfMemoryError" in proc.stderr
    files = sorted(tmp_path.glob("*_oom.pickle"))
    assert len(files) == 1, (list(tmp_path.iterdir()), proc.stderr[-3000:])
    snapshot = pickle.loads(files[0].read_bytes())
    assert snapshot["segments"]
    actions = {e["action"] for t in snapshot["device_traces"] for e in t}
    assert "oom" in actions  # history was on since start-up, so the OOM itself is recorded
    meta = json.loads(files[0].with_name(files[0].name + ".json").read_text())
    assert meta["meta"]["alloc_size"] >= 2 << 30


def test_loading_many_tensor_files_shows_in_host_metrics():
    r = run_scenario("host_memory_load")
    before, after, loaded = r["before"], r["after"], r["loaded_bytes"]
    assert loaded == 8 << 30
    grew = after["process_resident_bytes"] - before["process_resident_bytes"]
    assert grew >= 0.9 * loaded
    assert after["process_resident_peak_bytes"] >= before["process_resident_bytes"] + 0.9 * loaded
    # The machine's available memory falls with it. The GPU machines are VMs whose MemTotal
    # grows as memory is used (KINDS.md), so growth of the total counts as taken too.
    taken = (
        before["available_bytes"]
        - after["available_bytes"]
        + after["total_bytes"]
        - before["total_bytes"]
    )
    assert taken >= 0.5 * loaded


@pytest.mark.multigpu
@pytest.mark.skipif(_devices() < 2, reason="needs two GPUs")
def test_run_two_ranks_on_two_gpus(tmp_path):
    """`gpumem-exporter run`: both ranks' allocators under one endpoint, each on its own GPU
    only, and a snapshot fan-out that returns one file per rank."""
    import pickle
    import socket
    import time
    import urllib.request

    import pynvml
    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    control = tmp_path / "control"
    control.mkdir()
    env = dict(os.environ, GPUMEM_ADMIN_TOKEN="t", GPUMEM_SNAPSHOT_DIR=str(tmp_path / "snaps"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exporter.cli",
            "run",
            "--port",
            str(port),
            "--interval-s",
            "0.2",
            "--",
            sys.executable,
            str(REPO_ROOT / "tests" / "gpu_ranks.py"),
            str(control),
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        series: dict = {}
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
            except OSError:
                time.sleep(0.5)
                continue
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
            series = {
                s.labels["rank"]: s for s in samples if s.name == "torch_cuda_allocated_bytes"
            }
            if len(series) == 2 and all(s.value >= 256 * MiB for s in series.values()):
                break
            time.sleep(0.5)
        assert set(series) == {"0", "1"}, series
        pids = {r: int((control / f"ready{r}").read_text()) for r in ("0", "1")}
        for rank, sample in series.items():
            assert sample.labels["pid"] == str(pids[rank])
            assert sample.labels["device"] == rank and sample.labels["role"] == f"rank{rank}"
            assert sample.value >= (int(rank) + 1) * 256 * MiB
        assert series["0"].labels["gpu_uuid"] != series["1"].labels["gpu_uuid"]
        outside = {s.labels["rank"] for s in samples if s.name == "torch_cuda_non_allocator_bytes"}
        assert outside == {"0", "1"}
        # Independent check: each rank's process holds memory on its own GPU and no other.
        pynvml.nvmlInit()
        where: dict = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                where.setdefault(p.pid, []).append(pynvml.nvmlDeviceGetUUID(handle))
        for rank, pid in pids.items():
            assert where.get(pid) == [series[rank].labels["gpu_uuid"]], (rank, where)
        # Snapshot fan-out: one file per rank, each holding only its own GPU's segments.
        request = urllib.request.Request(
            url + "/snapshot",
            data=b"{}",
            method="POST",
            headers={"Authorization": "Bearer t", "Content-Type": "application/json"},
        )
        result = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert result["ok"] and len(result["processes"]) == 2
        for entry in result["processes"]:
            rank = entry["process"]["rank"]
            info = entry["result"]
            raw = urllib.request.urlopen(
                urllib.request.Request(
                    url + f"/snapshots/{info['id']}", headers={"Authorization": "Bearer t"}
                ),
                timeout=60,
            ).read()
            assert {s["device"] for s in pickle.loads(raw)["segments"]} == {int(rank)}
    finally:
        (control / "stop").touch()
        proc.send_signal(__import__("signal").SIGTERM)
        proc.wait(60)
