"""The series budget of issue 27 on a TP=8 server's node, as bench.fleet_series builds it with
the exporter's own collector and detectors: at the default detail level at most 40 series per
GPU at the server's `run` endpoint and 10 from the node daemon, and a restart of the server
(every pid new) changes at most 10% of the series' identities."""

from __future__ import annotations

import pytest

from bench.fleet_series import measure


@pytest.fixture(scope="module")
def basic() -> dict:
    return measure(8)["endpoints"]


@pytest.mark.slow
def test_a_tp8_node_keeps_the_series_budget(basic) -> None:
    assert basic["run"]["series_per_gpu"] <= 40
    assert basic["node"]["series_per_gpu"] <= 10


def test_a_restart_changes_at_most_a_tenth_of_the_identities(basic) -> None:
    for endpoint in ("run", "node"):
        assert basic[endpoint]["changed_by_restart_share"] <= 0.10, endpoint


def test_only_firing_alert_states_are_series(basic) -> None:
    """Every state of every rank is evaluated on the run endpoint: only those firing are
    served (after the demo's OOM: retries, OOM and fragmentation OOM on each of 8 ranks)."""
    assert 0 < basic["run"]["by_family"]["gpumem_exporter_alert_firing"] <= 24


@pytest.mark.slow
def test_the_full_level_adds_the_breakdowns() -> None:
    full = measure(8, "full")["endpoints"]
    assert full["run"]["by_family"]["torch_cuda_pool_reserved_bytes"] == 16
    assert full["node"]["by_family"]["gpu_process_pod_info"] == 8
