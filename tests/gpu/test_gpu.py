"""Checks on a real GPU: every number against an independent reading, and no stray contexts.

Run on the GPU machine: `pytest -m gpu`. Each scenario runs in a fresh process
(tests/support/gpu_scenarios.py) because allocator settings and CUDA contexts are per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, repo_env, run_support_script

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MiB = 1 << 20


def run_scenario(name: str, *args: str, alloc_conf: str = "") -> dict:
    return run_support_script("gpu_scenarios.py", name, *args, alloc_conf=alloc_conf)


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
    # A CUDA context plus cuBLAS/kernels is hundreds of MB (docs/facts.md: ~520-545 MB).
    assert 100 * MiB < outside < 4096 * MiB
    gpu = next(
        g for g in r["sample"]["gpus"] if g["uuid"] == r["sample"]["allocators"][0]["gpu_uuid"]
    )
    assert (
        gpu["total_bytes"] == gpu["used_bytes"] + gpu["free_bytes"] + gpu["driver_reserved_bytes"]
    )


def test_embedded_reads_only_its_gpus_and_reads_them_again_when_memory_moves():
    r = run_scenario("own_gpus_and_process_cadence")
    # Only the GPU this process uses, joined by UUID (the others are the node daemon's).
    assert r["gpus_read"] == [r["uuid_cuda0"]]
    assert r["process_gpus"] == [r["uuid_cuda0"]]
    # Reserved grew by 1 GiB: the tick after reads the process list again (no 10 s wait),
    # and the non-allocator bytes are taken again, equal to an independent NVML reading.
    assert r["moved_reserved"] >= r["first_reserved"] + 1024 * MiB
    assert r["moved_flag"] is False
    assert r["moved_process_used"] == [r["truth_used"]]
    assert r["moved"]["0"] == r["truth_used"] - r["moved_reserved"]
    assert r["moved"] == r["first"] and r["moved_age_s"] == 0.0
    # Nothing moved since: the list is reused and the value kept, with its age.
    assert r["still_flag"] is True and r["still"] == r["moved"]
    assert r["still_age_s"] >= 0.2


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
        "memory_limit_bytes",  # the fraction applies to cudaMallocAsync too
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


def test_the_memory_limit_is_where_the_allocator_refuses():
    r = run_scenario("memory_limit")
    assert r["uncapped"] == r["total_memory"]  # no fraction set: the whole device
    assert r["limit"] == int(r["fraction"] * r["total_memory"]) and r["fraction"] == 0.25
    assert r["served_under"] and r["refused_past"], r


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
    # The OOM observer's snapshot (on by default) and remediation's, taken after it.
    assert r["snapshots"] == {"oom": 1, "remediation": 1} and len(r["snapshot_files"]) == 2
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

    env = repo_env(SNAPSHOT_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "support" / "gpu_scenarios.py"), "oom_exit"],
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
    env = repo_env(GPUMEM_ADMIN_TOKEN="t", GPUMEM_SNAPSHOT_DIR=str(tmp_path / "snaps"))
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
            str(REPO_ROOT / "tests" / "support" / "gpu_ranks.py"),
            str(control),
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        series: dict = {}
        outside: set = set()
        allocated_at = None
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
            outside = {
                s.labels["rank"] for s in samples if s.name == "torch_cuda_non_allocator_bytes"
            }
            if len(series) == 2 and all(s.value >= 256 * MiB for s in series.values()):
                allocated_at = allocated_at or time.monotonic()
                if outside == {"0", "1"}:
                    break
            time.sleep(0.5)
        assert set(series) == {"0", "1"}, series
        # A rank's bytes outside the allocator need NVML to list its process: they come
        # with the probe's next full sample once it does (about a second), not the 10 s one.
        assert outside == {"0", "1"}
        assert allocated_at is not None and time.monotonic() - allocated_at < 5.0
        pids = {r: int((control / f"ready{r}").read_text()) for r in ("0", "1")}
        # Ranked processes' series carry no pid (they keep their identity across a restart);
        # gpumem_exporter_process_info names each rank's pid.
        info = {
            s.labels["rank"]: s.labels["pid"]
            for s in samples
            if s.name == "gpumem_exporter_process_info"
        }
        for rank, sample in series.items():
            assert sample.labels["pid"] == "" and info[rank] == str(pids[rank])
            assert sample.labels["device"] == rank and sample.labels["role"] == f"rank{rank}"
            assert sample.value >= (int(rank) + 1) * 256 * MiB
        assert series["0"].labels["gpu_uuid"] != series["1"].labels["gpu_uuid"]
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


def _vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.multigpu
@pytest.mark.skipif(_devices() < 2, reason="needs two GPUs")
def test_torchrun_under_run_actions_oom_alerts_and_host_memory(tmp_path):
    """torchrun with 2 ranks under `gpumem-exporter run`: every admin action per rank and
    fanned out through the CLI; rank 1 retries and OOMs under a cap, and only its alerts
    fire, its OOM snapshot listed and viewable; the host-memory incident with 16 GiB of
    tensor files: the validation worker's RSS on /metrics matches /proc while rank 0 grows
    its GPU memory by 48 GiB."""
    import signal
    import socket
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    report: dict = {}
    files = []
    for i in range(4):  # 4 x 4 GiB of captured tensors
        path = tmp_path / f"capture{i}.pt"
        torch.save(torch.full((4 << 30,), i + 1, dtype=torch.uint8), path)
        files.append(str(path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    control = tmp_path / "control"
    control.mkdir()
    token = tmp_path / "token"
    token.write_text("t")
    env = repo_env(
        GPUMEM_ADMIN_TOKEN="t",
        GPUMEM_SNAPSHOT_DIR=str(tmp_path / "snaps"),
        GPUMEM_OOM_SNAPSHOT="1",
        GPUMEM_EMPTY_CACHE_COOLDOWN_S="0",
    )
    launcher = [sys.executable, "-m", "exporter.cli", "run", "--port", str(port)]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    proc = subprocess.Popen(
        [
            *launcher,
            "--interval-s",
            "0.2",
            "--",
            *torchrun,
            str(REPO_ROOT / "tests" / "support" / "gpu_torchrun.py"),
            str(control),
            *files,
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"

    def scrape() -> list:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        return [s for f in text_string_to_metric_families(text) for s in f.samples]

    def cli(*args: str) -> tuple[int, Any, str]:
        done = subprocess.run(
            [
                *(sys.executable, "-m", "exporter.cli", *args, "--url", url),
                *(("--json",) if args[0] != "snapshot" else ()),
                *("--token-file", str(token)),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        try:
            out: Any = json.loads(done.stdout)
        except ValueError:
            out = done.stdout
        return done.returncode, out, done.stderr

    def wait(predicate, what: str, timeout_s: float = 180):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                value = predicate()
            except OSError:
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    def by_rank(name: str) -> dict:
        return {s.labels["rank"]: s for s in scrape() if s.name == name}

    try:
        wait(lambda: len(by_rank("torch_cuda_allocated_bytes")) == 2, "both ranks")
        pids = {r: (control / f"ready{r}").read_text() for r in ("0", "1")}

        # Snapshots: fanned out (one file per rank, only its own GPU), and for rank 1 only.
        code, out, err = cli("snapshot", "-o", str(tmp_path / "all.pickle"))
        assert code == 0, err
        import pickle

        for rank, pid in pids.items():
            snap = pickle.loads((tmp_path / f"all.pid{pid}.pickle").read_bytes())
            assert {s["device"] for s in snap["segments"]} == {int(rank)}
        code, out, err = cli("snapshot", "-o", str(tmp_path / "r1.pickle"), "--rank", "1")
        assert code == 0 and (tmp_path / "r1.pickle").stat().st_size > 0, err
        # empty-cache, history, reset-peak, stats: per rank and fanned out.
        code, out, _ = cli("empty-cache", "--rank", "0")
        assert code == 0 and [p["process"]["rank"] for p in out["processes"]] == ["0"]
        code, out, _ = cli("empty-cache")
        assert code == 0 and sorted(p["process"]["rank"] for p in out["processes"]) == ["0", "1"]
        code, out, _ = cli("history", "start", "--rank", "1", "--max-entries", "10000")
        assert code == 0 and out["processes"][0]["result"]["enabled"] is True
        code, out, _ = cli("history", "status")
        assert {p["process"]["rank"]: p["result"]["enabled"] for p in out["processes"]} == {
            "0": False,
            "1": True,
        }
        code, out, _ = cli("history", "stop", "--rank", "1")
        assert code == 0 and out["processes"][0]["result"]["snapshot"]["trigger"] == "history"
        code, out, _ = cli("reset-peak")
        assert code == 0
        assert {p["process"]["rank"]: p["result"]["devices"] for p in out["processes"]} == {
            "0": [0],
            "1": [1],
        }
        code, out, _ = cli("stats", "--rank", "1")
        assert [a["device"] for a in out["sample"]["allocators"]] == [1]

        # Rank 1 retries and runs out of memory: its alerts fire, rank 0's do not.
        (control / "oom1").touch()
        assert (
            wait(
                lambda: (control / "oom1-done").exists() and (control / "oom1-done").read_text(),
                "oom",
            )
            == "oom"
        )

        def firing() -> dict:
            return {
                (s.labels["alert"], s.labels["rank"]): s.value
                for s in scrape()
                if s.name == "gpumem_exporter_alert_firing"
            }

        alerts = wait(
            lambda: (
                (f := firing()).get(("GpuMemOutOfMemory", "1")) == 1
                and f.get(("GpuMemAllocRetries", "1")) == 1
                and f
            ),
            "rank 1's alerts",
        )
        assert alerts.get(("GpuMemOutOfMemory", "0"), 0) == 0
        assert alerts.get(("GpuMemAllocRetries", "0"), 0) == 0
        counters = by_rank("torch_cuda_ooms_total")
        report["ooms"] = {r: s.value for r, s in counters.items()}
        assert counters["1"].value >= 1 and counters["0"].value == 0
        # Rank 1's verdict, taken in its own process: a 2 GiB cap on a GPU with room. Rank 0
        # has none.
        verdicts = {
            (s.labels["rank"], s.labels["verdict"]): s.value
            for s in scrape()
            if s.name == "torch_cuda_ooms_by_verdict_total"
        }
        report["verdicts"] = {f"{r}/{v}": n for (r, v), n in verdicts.items()}
        assert verdicts == {("1", "cap"): counters["1"].value}
        code, out, _ = cli("why")
        assert code == 0
        (rank1,) = [d for d in out["devices"] if d["last_oom"]]
        assert rank1["process"]["rank"] == "1" and rank1["last_oom"]["verdict"] == "cap"
        assert rank1["last_oom"]["requested_bytes"] == 4 << 30
        listed = wait(
            lambda: [
                s
                for s in json.loads(
                    urllib.request.urlopen(
                        urllib.request.Request(
                            url + "/snapshots", headers={"Authorization": "Bearer t"}
                        ),
                        timeout=30,
                    ).read()
                )["snapshots"]
                if s["trigger"] == "oom"
            ],
            "the OOM snapshot",
        )
        assert listed[0]["meta"]["process"]["rank"] == "1" and listed[0]["meta"]["device"] == 1
        view = urllib.request.urlopen(
            urllib.request.Request(
                url + f"/snapshots/{listed[0]['id']}/view", headers={"Authorization": "Bearer t"}
            ),
            timeout=60,
        )
        assert view.status == 200

        # The incident: a validation worker holds 16 GiB of tensors while rank 0 grows GPU memory.
        reserved_before = by_rank("torch_cuda_reserved_bytes")["0"].value
        available_before = next(
            s.value for s in scrape() if s.name == "host_memory_available_bytes"
        )
        (control / "validate").touch()
        validator = int(
            wait(
                lambda: (
                    (control / "validator-ready").exists()
                    and (control / "validator-ready").read_text()
                ),
                "validator",
                600,
            )
        )
        (control / "grow").touch()
        wait(lambda: (control / "grown").exists(), "rank 0 to grow", 300)
        time.sleep(0.6)  # a few intervals
        samples = scrape()
        pid_of = {
            (s.labels["rank"], s.labels["role"]): s.labels["pid"]
            for s in samples
            if s.name == "gpumem_exporter_process_info"
        }
        rss = {
            s.labels["pid"] or pid_of[(s.labels["rank"], s.labels["role"])]: s
            for s in samples
            if s.name == "host_process_resident_memory_bytes"
        }
        exported = rss[str(validator)].value
        truth = _vm_rss(validator)
        grown = by_rank("torch_cuda_reserved_bytes")["0"].value - reserved_before
        available_after = next(s.value for s in samples if s.name == "host_memory_available_bytes")
        report.update(
            validator_pid=validator,
            validator_role=rss[str(validator)].labels["role"],
            validator_rss_exported=exported,
            validator_rss_proc=truth,
            rank0_pid=pids["0"],
            rank0_rss_exported=rss[pids["0"]].value,
            rank0_reserved_growth=grown,
            available_drop=available_before - available_after,
        )
        assert abs(exported - truth) <= 0.05 * truth and exported >= 16 * (1 << 30)
        assert rss[str(validator)].labels["role"] == "validate"
        assert str(validator) not in pids.values()  # a different process from the GPU one
        assert grown >= 48 * (1 << 30)
        assert rss[pids["0"]].value < exported / 4
    finally:
        (control / "stop").touch()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        out_dir = os.environ.get("GPUMEM_TEST_REPORT_DIR")
        if out_dir:
            with open(os.path.join(out_dir, "torchrun_report.json"), "w") as f:
                json.dump(report, f, indent=2)


def _layout(used: str = "0", alloc_conf: str = "") -> tuple[dict, dict]:
    os.environ["GPUMEM_LAYOUT_INTERVAL_S"] = "0.2"
    try:
        r = run_scenario("layout", used, alloc_conf=alloc_conf)
    finally:
        del os.environ["GPUMEM_LAYOUT_INTERVAL_S"]
    assert r["error"] is None
    assert r["walk"] == r["walk_after"], "the allocator moved while the test read it"
    values = {}
    for name, labels, value in r["series"]:
        key = name if "pool_id" not in labels else f"{name}/{labels['pool_id']}"
        values[key] = value
    return r, values


def test_layout_matches_an_independent_snapshot_walk_on_the_native_allocator():
    r, m = _layout()
    walk = r["walk"]
    assert m["torch_cuda_largest_free_block_bytes"] == walk["largest_free_block_bytes"] > 0
    assert m["torch_cuda_default_pool_free_bytes"] == walk["default_pool_free_bytes"]
    assert m["torch_cuda_free_in_used_segments_bytes"] == walk["free_in_used_segments_bytes"]
    # Native allocator: the same bytes as the allocator's own inactive_split count.
    assert m["torch_cuda_free_in_used_segments_bytes"] == r["inactive_split_bytes"] > 0
    assert m["torch_cuda_layout_age_seconds"] < 1.0
    # The captured graph's private pool, under its own id, equal to its segments.
    pool = walk["private_pools"][r["graph_pool"]]
    assert m[f"torch_cuda_private_pool_reserved_bytes/{r['graph_pool']}"] == pool["reserved"]
    assert m[f"torch_cuda_private_pool_allocated_bytes/{r['graph_pool']}"] == pool["allocated"]
    assert pool["allocated"] >= 96 * MiB
    # 4 GiB pinned host tensor: 4 GiB held and in use, as torch's own stats say.
    assert m["torch_cuda_pinned_host_bytes"] == r["pinned_tensor_bytes"] == 4 << 30
    assert m["torch_cuda_pinned_host_bytes"] == r["host_stats_held"]
    assert m["torch_cuda_pinned_host_in_use_bytes"] == 4 << 30
    assert "torch_cuda_layout_skipped_info" not in m


def test_layout_defines_fragmentation_with_expandable_segments():
    r, m = _layout(alloc_conf="expandable_segments:True")
    walk = r["walk"]
    assert r["inactive_split_bytes"] == 0  # not tracked there (pytorch/pytorch#159564)
    assert "torch_cuda_inactive_split_bytes" not in m
    assert m["torch_cuda_free_in_used_segments_bytes"] == walk["free_in_used_segments_bytes"] > 0
    assert m["torch_cuda_largest_free_block_bytes"] == walk["largest_free_block_bytes"]
    assert m["torch_cuda_default_pool_free_bytes"] == walk["default_pool_free_bytes"]
    graph_pool = f"torch_cuda_private_pool_reserved_bytes/{r['graph_pool']}"
    assert m[graph_pool] == walk["private_pools"][r["graph_pool"]]["reserved"]
    info = [labels for name, labels, _ in r["series"] if name == "torch_cuda_allocator_info"]
    assert info and info[0]["settings_source"] == "live"
    assert info[0]["expandable_segments"] == "true"


def test_layout_is_absent_on_cuda_malloc_async_but_pinned_memory_is_not():
    r, m = _layout(alloc_conf="backend:cudaMallocAsync")
    assert r["walk"] is None  # no snapshot on this backend
    assert "torch_cuda_largest_free_block_bytes" not in m
    assert not any(name.startswith("torch_cuda_private_pool") for name in m)
    assert m["torch_cuda_pinned_host_bytes"] == 4 << 30


@pytest.mark.multigpu
@pytest.mark.skipif(_devices() < 2, reason="needs two GPUs")
def test_layout_and_pinned_reads_create_no_context_on_an_unused_gpu():
    r, m = _layout("1")
    assert [i for i, has in enumerate(r["has_context"]) if has] == [1]
    assert r["pid_on_gpus"] == [r["used_uuid"]]
    assert m["torch_cuda_largest_free_block_bytes"] == r["walk"]["largest_free_block_bytes"]
    assert m["torch_cuda_pinned_host_bytes"] == 4 << 30


def test_expandable_segments_turned_on_at_run_time_is_said_within_one_layout_interval():
    """Issue 52 item 5 on the GPU: torch's private setter (as vLLM uses) flips the setting; the
    settings info, the change series and the alert follow within one layout interval."""
    from prometheus_client.parser import text_string_to_metric_families

    r = run_scenario("settings_flip")

    def samples(text: str, name: str) -> list[Any]:
        return [
            s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
        ]

    assert r["error"] is None and r["truth_expandable"] is True
    [before] = samples(r["before"], "torch_cuda_allocator_info")
    [after] = samples(r["after"], "torch_cuda_allocator_info")
    assert (before.labels["expandable_segments"], before.labels["settings_source"]) == (
        "false",
        "live",
    )
    assert after.labels["expandable_segments"] == "true", r["after"]
    [change] = samples(r["after"], "gpumem_exporter_allocator_settings_change_info")
    assert (change.labels["setting"], change.labels["from"], change.labels["to"]) == (
        "expandable_segments",
        "false",
        "true",
    )
    [total] = samples(r["after"], "gpumem_exporter_allocator_settings_changes_total")
    assert total.value == 1
    firing = samples(r["after"], "gpumem_exporter_alert_firing")
    assert any(
        s.labels["alert"] == "GpuMemAllocatorSettingsChanged" and s.value == 1 for s in firing
    )
    assert r["seen_s"] is not None and r["seen_s"] <= r["layout_interval_s"] + 1.0


def _check_ledger(r: dict[str, Any]) -> None:
    parts, truth = r["parts"], r["truth"]
    assert r["error"] is None and r["nvml_used"] is not None, r
    # Each component is the allocated bytes it added (an independent torch reading).
    assert parts["weights"] == truth["weights"] > 0, r
    assert parts["kv_cache"] == truth["kv_cache"] > 0, r
    assert parts["other_live"] >= 100 * MiB, r  # the unnamed tensor
    assert parts["cached_free"] == r["reserved"] - r["allocated"], r
    # The parts sum to NVML's per-process used, to the MiB.
    assert abs(sum(parts.values()) - r["nvml_used"]) < MiB, r


def test_components_and_the_ledger_on_a_real_allocator():
    """Issue 52: a model load and a KV cache wrapped in exporter.component(), embedded."""
    _check_ledger(run_scenario("ledger"))


def test_components_and_the_ledger_under_run(tmp_path):
    """The same under `gpumem-exporter run`: the agent reads the process's components."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    script = str(REPO_ROOT / "tests" / "support" / "gpu_scenarios.py")
    out = subprocess.run(
        [sys.executable, "-m", "exporter.cli", "run", "--port", str(port), "--interval-s", "0.2",
         "--", sys.executable, script, "ledger", url],
        capture_output=True, text=True, timeout=180, cwd=REPO_ROOT,
        env=repo_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    _check_ledger(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_graph_pool_and_a_named_mempool_on_a_real_allocator():
    """Issue 52 item 2: a captured CUDA graph's pool shows as kind graph, a MemPool named
    with exporter.name_pool as kind mempool with its name; each pool's bytes are those the
    allocator's own snapshot gives it."""
    from prometheus_client.parser import text_string_to_metric_families

    r = run_scenario("pool_kinds")
    assert r["error"] is None
    rows: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(r["metrics"]):
        for sample in family.samples:
            if sample.name.startswith("torch_cuda_private_pool") and "pool_id" in sample.labels:
                row = rows.setdefault(sample.labels["pool_id"], {})
                if sample.name == "torch_cuda_private_pool_info":
                    row["kind"], row["name"] = sample.labels["kind"], sample.labels["name"]
                else:
                    row[sample.name.removeprefix("torch_cuda_private_pool_")] = int(sample.value)
    assert set(rows) == set(r["truth"]), (rows, r["truth"])
    graphs = [label for label, row in rows.items() if row["kind"] == "graph"]
    assert len(graphs) == 1 and int(graphs[0].split("_")[0]) > 0, rows
    assert rows[r["mempool"]]["kind"] == "mempool" and rows[r["mempool"]]["name"] == "kv_cache"
    assert rows[r["mempool"]]["allocated_bytes"] == 256 * MiB
    for label, truth in r["truth"].items():
        assert rows[label]["reserved_bytes"] == truth["reserved_bytes"], (label, rows, truth)
        assert rows[label]["allocated_bytes"] == truth["allocated_bytes"], (label, rows, truth)
