"""The command line, run as a user runs it: real processes, real HTTP, real promtool."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.trace import read_trace
from tests.conftest import require_tool
from tests.helpers import CLI, run_cli, running


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def first(values: dict, name: str) -> float:
    return next(v for (n, _), v in values.items() if n == name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [[], ["serve"], ["demo"], ["record"], ["run"], ["snapshot"], ["empty-cache"], ["view"]],
)
def test_help_everywhere(command):
    proc = run_cli(*command, "--help")
    assert proc.returncode == 0 and "usage: gpumem-exporter" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--port", "http"], "port: expected an integer"),
        (["demo", "--interval-s", "-1"], "--interval-s: expected seconds"),
        (["demo", "--trace", "/nonexistent.gz"], "trace file not found: /nonexistent.gz"),
        (["serve", "--labels", "pod=x"], "unreserved label name"),
        (["record", "--url", "ftp://x", "-o", "t.gz", "--duration-s", "1"], "http(s) URL"),
        (
            [
                "record",
                "--url",
                "http://127.0.0.1:9",
                "-o",
                "/nonexistent/t.gz",
                "--duration-s",
                "1",
            ],
            "output directory does not exist",
        ),
        (
            ["record", "--url", "http://127.0.0.1:9", "-o", "t.gz", "--duration-s", "0"],
            "--duration-s must be positive",
        ),
    ],
)
def test_user_errors_are_one_line_and_exit_2(args, message, tmp_path):
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_bad_trace_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.gz"
    bad.write_text("not a trace")
    proc = run_cli("demo", "--trace", str(bad))
    assert proc.returncode == 2 and "is not a gzip trace file" in proc.stderr


@pytest.mark.slow
def test_a_taken_port_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("demo", "--port", str(port))
    assert proc.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr


@pytest.mark.slow
def test_demo_serves_moving_allocator_nvml_and_host_metrics_that_promtool_accepts():
    promtool = require_tool("promtool")
    with running("demo", "--interval-s", "0.5") as url:
        before = scrape(url)
        time.sleep(4)
        after = scrape(url)
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    for family in (
        "torch_cuda_allocated_bytes",
        "torch_cuda_reserved_bytes",
        "torch_cuda_inactive_split_bytes",
        "torch_cuda_fragmentation_ratio",
        "torch_cuda_alloc_retries_total",
        "torch_cuda_ooms_total",
        "torch_cuda_non_allocator_bytes",
        "gpu_memory_used_bytes",
        "gpu_memory_free_bytes",
        "host_memory_available_bytes",
        "process_resident_memory_bytes",
        "gpumem_exporter_last_sample_timestamp_seconds",
    ):
        assert any(name == family for name, _ in after), family
    assert first(after, "gpumem_exporter_build_info") == 1
    assert ("gpumem_exporter_build_info", (("mode", "demo"), ("version", "0.1.0"))) in after
    moved = [
        name
        for name in (
            "torch_cuda_allocated_bytes",
            "torch_cuda_active_bytes",
            "gpu_memory_used_bytes",
            "host_memory_available_bytes",
        )
        if first(before, name) != first(after, name)
    ]
    assert "torch_cuda_allocated_bytes" in moved
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


@pytest.mark.slow
def test_record_a_running_exporter_and_replay_it(tmp_path):
    trace = tmp_path / "incident.jsonl.gz"
    # At the full detail level: a recording keeps every family the server serves.
    with running("demo", "--interval-s", "0.2", "--detail", "full") as url:
        # The demo's CUDA-graph pool appears in its first seconds: record once it is there, so
        # that the recording and the live scrape after it show the same families.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            n == "torch_cuda_private_pool_reserved_bytes" for n, _ in scrape(url)
        ):
            time.sleep(0.2)
        proc = run_cli(
            "record",
            "--url",
            url,
            "-o",
            str(trace),
            "--duration-s",
            "1.5",
            "--interval-s",
            "0.25",
            umask=0o002,
        )
        assert proc.returncode == 0, proc.stderr
        live = scrape(url)
    assert "recorded" in proc.stdout
    assert stat.S_IMODE(trace.stat().st_mode) == 0o664  # the user's file: their umask
    meta, samples = read_trace(trace)
    assert meta["source_url"] == url + "/metrics"
    assert len(samples) >= 4
    assert samples[-1].allocators and samples[-1].gpus and samples[-1].host
    with running("demo", "--trace", str(trace), "--no-loop", "--detail", "full") as url:
        replayed = scrape(url)
    assert first(replayed, "torch_cuda_reserved_bytes") > 0
    assert {n for n, _ in replayed if n.startswith("torch_cuda")} == {
        n for n, _ in live if n.startswith("torch_cuda")
    }


@pytest.mark.slow
def test_serve_without_nvml_reports_the_source_down_and_host_up():
    # Healthy (it serves), but a node daemon that sees no GPU is not ready (below).
    with running("serve", wait_for="/healthz") as url:
        time.sleep(2.5)  # a few ticks: a failing source would have counted errors by now
        values = scrape(url)
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            health = json.loads(response.read())
        try:
            urllib.request.urlopen(url + "/readyz", timeout=5)
            readiness: tuple[int, dict] = (200, {})
        except urllib.error.HTTPError as error:
            readiness = (error.code, json.loads(error.read()))
    assert health["status"] == "ok"
    up = {
        dict(labels)["source"]: v
        for (n, labels), v in values.items()
        if n == "gpumem_exporter_source_up"
    }
    assert up["host"] == 1
    # The node daemon never reads torch; the host memory of GPU processes (host_process_*)
    # only at the full detail level.
    assert set(up) == {"nvml", "host"}
    if not Path("/dev/nvidiactl").exists():
        # No GPU stack here: no data with its reason, not a failing source (which would page
        # through GpuMemExporterSourceFailing every tick).
        assert up["nvml"] == 1
        reasons = {
            dict(labels)["source"]: dict(labels)["reason"]
            for (n, labels), v in values.items()
            if n == "gpumem_exporter_source_unavailable_info"
        }
        assert reasons["nvml"] in ("NVML Shared Library Not Found", "Driver Not Loaded", "no GPU")
        assert readiness == (503, {"ready": False, "reason": f"NVML: {reasons['nvml']}"})
        errors = {
            dict(labels)["source"]: v
            for (n, labels), v in values.items()
            if n == "gpumem_exporter_source_errors_total"
        }
        assert errors["nvml"] == 0
        assert health["unavailable_sources"]["nvml"] == reasons["nvml"]


@pytest.mark.slow
def test_entry_point_is_installed():
    exe = Path(sys.executable).parent / "gpumem-exporter"
    if not exe.exists():
        pytest.skip("package not installed with its console script")
    proc = subprocess.run(
        [str(exe), "--version"], capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )
    assert proc.returncode == 0 and proc.stdout.startswith("gpumem-exporter 0.1.0")


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [["snapshot"], ["empty-cache"], ["history", "status"], ["reset-peak"], ["stats"]]
)
def test_each_option_names_the_variable_it_reads(command):
    help_text = flat(run_cli(*command, "--help").stdout)
    assert (
        "--token-file TOKEN_FILE file holding the admin bearer token [GPUMEM_ADMIN_TOKEN_FILE]"
        in (help_text)
    )
    assert (
        "The token comes from --token-file, else from the file named by "
        "GPUMEM_ADMIN_TOKEN_FILE, else from GPUMEM_ADMIN_TOKEN" in help_text
    )
    assert "[GPUMEM_ADMIN_TOKEN]" not in help_text


@pytest.mark.slow
def test_empty_cache_device_says_which_gpu_in_plain_words():
    help_text = flat(run_cli("empty-cache", "--help").stdout)
    assert (
        "--device N which GPU the call runs on, by its number inside the server process (the "
        "CUDA device number after CUDA_VISIBLE_DEVICES, not nvidia-smi's index)" in help_text
    )
    assert "every GPU of the process" in help_text and "guard" not in help_text


@pytest.mark.slow
def test_view_writes_the_users_file_with_the_users_umask(tmp_path):
    from exporter.actions.replay import demo_snapshot_path

    page = tmp_path / "snap.html"
    proc = run_cli("view", str(demo_snapshot_path()), "-o", str(page), umask=0o027)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(page.stat().st_mode) == 0o640  # like `> FILE`, not 0600
    page.chmod(0o600)  # a user who closed it keeps it closed when writing it again
    proc = run_cli("view", str(demo_snapshot_path()), "-o", str(page), umask=0o002)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(page.stat().st_mode) == 0o600


@pytest.mark.slow
def test_view_writes_beside_the_snapshot_without_o(tmp_path):
    import shutil

    from exporter.actions.replay import demo_snapshot_path

    snapshot = tmp_path / "oom-at-53s.pickle.gz"
    shutil.copy(demo_snapshot_path(), snapshot)
    proc = run_cli("view", str(snapshot))
    assert proc.returncode == 0, proc.stderr
    page = tmp_path / "oom-at-53s.html"
    assert proc.stdout.strip() == f"wrote {page}"
    assert page.read_text().startswith("<!DOCTYPE html>")
