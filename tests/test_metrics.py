"""Exposition: names, labels and values rendered from real samples, checked by promtool."""

from __future__ import annotations

import json
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.identity import identity_labels
from exporter.sample import (
    PinnedHostReading,
)
from exporter.sources.replay import demo_trace_path
from exporter.trace import read_trace
from tests.conftest import DATA_DIR, require_tool
from tests.helpers import captured_sample, render


def samples_by_name(text: str) -> dict[str, list]:
    result: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            result.setdefault(s.name, []).append(s)
    return result


def test_native_capture_renders_the_contract():
    sample = captured_sample("native")
    metrics = samples_by_name(render(sample))
    (allocated,) = metrics["torch_cuda_allocated_bytes"]
    assert allocated.labels == {"device": "0", "gpu_uuid": sample.allocators[0].gpu_uuid}
    assert allocated.value == sample.allocators[0].gauges["allocated_bytes"]
    for name in (
        "torch_cuda_reserved_bytes",
        "torch_cuda_inactive_split_bytes",
        "torch_cuda_fragmentation_ratio",
        "torch_cuda_cached_free_ratio",
        "torch_cuda_alloc_retries_total",
        "torch_cuda_ooms_total",
        "torch_cuda_segments",
        "torch_cuda_allocator_info",
        "gpu_memory_total_bytes",
        "gpu_memory_driver_reserved_bytes",
        "gpu_process_memory_used_bytes",
        "gpu_info",
        "gpu_up",
        "gpumem_exporter_source_up",
        "gpumem_exporter_build_info",
    ):
        assert name in metrics, name
    assert {s.labels["pool"] for s in metrics["torch_cuda_pool_reserved_bytes"]} == {
        "large",
        "small",
    }
    (info,) = metrics["torch_cuda_allocator_info"]
    assert info.labels["backend"] == "native" and info.labels["expandable_segments"] == "false"
    # The allocator's GPU joins NVML's on gpu_uuid.
    gpu_uuids = {s.labels["gpu_uuid"] for s in metrics["gpu_memory_total_bytes"]}
    assert allocated.labels["gpu_uuid"] in gpu_uuids


def test_non_allocator_bytes_is_this_processes_nvml_use_minus_reserved():
    sample = captured_sample("native")
    (outside,) = samples_by_name(render(sample))["torch_cuda_non_allocator_bytes"]
    mine = next(p for p in sample.processes if p.pid == sample.self_pid)
    assert outside.value == mine.used_bytes - sample.allocators[0].gauges["reserved_bytes"]
    # A CUDA context on an H200 is ~540 MB (docs/facts.md); the capture also ran a matmul (for
    # its CUDA graph), which loads cuBLAS's kernels outside the allocator: 782 MB there.
    assert 400e6 < outside.value < 1e9
    (age,) = samples_by_name(render(sample))["torch_cuda_non_allocator_age_seconds"]
    assert age.value == 0.0 and age.labels == outside.labels
    # NVML did not list the process (a container without the host PID namespace): neither.
    sample.allocators[0].non_allocator_bytes = sample.allocators[0].non_allocator_age_s = None
    rendered = samples_by_name(render(sample))
    assert "torch_cuda_non_allocator_bytes" not in rendered
    assert "torch_cuda_non_allocator_age_seconds" not in rendered


@pytest.mark.parametrize("name", ["expandable", "async"])
def test_undefined_numbers_are_absent_not_zero(name):
    metrics = samples_by_name(render(captured_sample(name)))
    assert "torch_cuda_fragmentation_ratio" not in metrics
    assert "torch_cuda_inactive_split_bytes" not in metrics
    assert "torch_cuda_cached_free_ratio" in metrics
    if name == "async":
        assert "torch_cuda_alloc_retries_total" not in metrics
        assert "torch_cuda_pool_reserved_bytes" not in metrics


def test_source_health_and_constant_labels():
    text = render(captured_sample("native"), labels={"model": "llama", "rank": "3"})
    metrics = samples_by_name(text)
    up = {s.labels["source"]: s.value for s in metrics["gpumem_exporter_source_up"]}
    assert up == {"torch": 1.0, "nvml": 0.0}
    errors = {s.labels["source"]: s.value for s in metrics["gpumem_exporter_source_errors_total"]}
    assert errors["nvml"] == 3
    assert all(s.labels.get("model") == "llama" for samples in metrics.values() for s in samples)


def test_identity_labels_come_from_rank_variables():
    assert identity_labels({"RANK": "3", "LOCAL_RANK": "1"}, {"model": "m"}) == {
        "rank": "3",
        "local_rank": "1",
        "model": "m",
    }
    assert identity_labels({}, {}) == {}


def test_before_the_first_sample_only_exporter_health_is_served():
    metrics = samples_by_name(render(None))
    assert "gpumem_exporter_source_up" in metrics
    assert not any(name.startswith(("torch_cuda", "gpu_", "host_")) for name in metrics)


def test_promtool_accepts_every_sample_of_the_demo_trace():
    promtool = require_tool("promtool")
    _, samples = read_trace(demo_trace_path())
    for sample in (
        samples[0],
        samples[len(samples) // 2],
        captured_sample("expandable"),
        captured_sample("async"),
    ):
        text = render(sample, labels={"model": "demo"})
        proc = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


def test_layout_private_pools_pinned_memory_and_live_settings_render(tmp_path):
    data = json.loads((DATA_DIR / "allocator_native.json").read_text())
    sample = captured_sample("native")
    sample.pinned_host = [PinnedHostReading(**p) for p in data["exporter_pinned_host"]]
    text = render(sample)
    metrics = samples_by_name(text)
    reading = sample.allocators[0]
    for key, value in reading.layout.items():
        (series,) = metrics[f"torch_cuda_{key}"]
        assert series.value == value and series.labels["device"] == "0"
    pools = {
        s.labels["pool_id"]: s.value for s in metrics["torch_cuda_private_pool_reserved_bytes"]
    }
    assert pools == {p: v["reserved_bytes"] for p, v in reading.private_pools.items()}
    assert "1_0" in pools  # the captured CUDA graph's pool
    (pinned,) = metrics["torch_cuda_pinned_host_bytes"]
    assert pinned.value == data["truth"]["pinned_tensor_bytes"] and pinned.labels == {}
    (cached,) = metrics["torch_cuda_pinned_host_cached_bytes"]
    assert cached.value == 0
    (info,) = metrics["torch_cuda_allocator_info"]
    assert info.labels["settings_source"] == "live"
    assert info.labels["garbage_collection_threshold"] == "0.0"
    assert "torch_cuda_layout_skipped_info" not in metrics
    path = tmp_path / "metrics.txt"
    path.write_text(text)
    require_tool("promtool")
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=text, text=True, capture_output=True
    )
    assert "error" not in (done.stdout + done.stderr).lower(), done.stdout + done.stderr


def test_a_skipped_layout_says_why_and_pinned_memory_is_per_process_under_run():
    sample = captured_sample("native")
    for reading in sample.allocators:
        reading.process = {"pid": "7", "rank": "0", "local_rank": "0", "role": "worker"}
        reading.layout, reading.layout_skipped, reading.layout_age_s = {}, "too_many_blocks", None
    sample.pinned_host = [
        PinnedHostReading(10, 4, {"pid": "7", "rank": "0", "local_rank": "0", "role": "worker"})
    ]
    metrics = samples_by_name(render(sample))
    (skipped,) = metrics["torch_cuda_layout_skipped_info"]
    assert skipped.labels["reason"] == "too_many_blocks" and skipped.labels["pid"] == "7"
    assert "torch_cuda_largest_free_block_bytes" not in metrics
    (held,) = metrics["torch_cuda_pinned_host_bytes"]
    assert held.labels == {"pid": "7", "rank": "0", "local_rank": "0", "role": "worker"}
    (cached,) = metrics["torch_cuda_pinned_host_cached_bytes"]
    assert cached.value == 6


def test_a_peak_is_never_below_the_current_value_it_is_served_beside():
    """ru_maxrss lags the RSS /proc reads (the H100 demo trace had it 1.4 MB below): clamped."""
    from exporter.sample import HostProcessReading, HostReading

    host = HostReading(
        100, 50, 0, 0, process_resident_bytes=656441344, process_resident_peak_bytes=654983168
    )
    assert host.process_resident_peak_bytes == 656441344
    assert HostReading(100, 50, 0, 0, 10, 12).process_resident_peak_bytes == 12
    assert HostReading(100, 50, 0, 0, None, 12).process_resident_peak_bytes == 12
    process = HostProcessReading(1, "server", "", resident_bytes=9, resident_peak_bytes=7)
    assert process.resident_peak_bytes == 9


def test_one_subjects_labels_give_each_family_its_own_label_values() -> None:
    """Labels makes a family's label values once per set of names: families of other names
    (or other constant labels) given the same subject get their own values, not the first's."""
    from exporter import catalog
    from exporter.fill.rows import FamilyRows, Labels

    subject = Labels({"device": 0, "gpu_uuid": "GPU-a", "pool": "large"})
    entry = catalog.family("torch_cuda_reserved_bytes")
    by_device = FamilyRows(entry, ("device", "gpu_uuid"), ("device", "gpu_uuid"), ())
    by_pool = FamilyRows(entry, ("device", "pool"), ("device", "pool"), ())
    ranked = FamilyRows(entry, ("rank", "device", "gpu_uuid"), ("device", "gpu_uuid"), ("3",))
    for _ in range(2):
        by_device.add(subject, 1.0)
        by_pool.add(subject, 2.0)
        ranked.add(subject, 3.0)
    assert by_device.rows == [(("0", "GPU-a"), 1.0)] * 2
    assert by_pool.rows == [(("0", "large"), 2.0)] * 2
    assert ranked.rows == [(("3", "0", "GPU-a"), 3.0)] * 2
