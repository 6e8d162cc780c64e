"""Issue 63 item 1: every OOM gets its verdict from the first allocation on. Each OOM made on
purpose in a fresh process, right after `exporter.start()` returns, as the process's first CUDA
allocation (start() before and after CUDA's initialization), and under `gpumem-exporter run`;
the verdict on /metrics within 1 s of the OOM (tests/support/oom_at_start.py). Before the
observer was armed at CUDA's initialization, none of these got a verdict within 30 s.
Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_oom_at_start.py`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, repo_env
from tests.helpers import free_port

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCRIPT = str(REPO_ROOT / "tests" / "support" / "oom_at_start.py")
WITHIN_S = 1.0
EXPANDABLE = "expandable_segments:True"

# (scenario, PYTORCH_CUDA_ALLOC_CONF, the verdict it must get): tests/gpu/test_gpu_oom.py's.
CAUSES = [
    ("fragmentation", "", "fragmentation"),
    ("cap", "", "cap"),
    ("cap", EXPANDABLE, "cap"),
    ("other_processes", "", "other_processes"),
    ("exhaustion", "", "exhaustion"),
    ("pools", "", "pools"),
    ("outside_allocator", "", "outside_allocator"),
]


def _env(alloc_conf: str) -> dict[str, str]:
    env = repo_env(PYTORCH_CUDA_ALLOC_CONF=alloc_conf)
    return env


def _ran(command: list[str], alloc_conf: str) -> dict:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, env=_env(alloc_conf)
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def at_start(scenario: str, when: str, alloc_conf: str = "") -> dict:
    port = free_port()
    if when == "run":
        command = [
            sys.executable, "-m", "exporter.cli", "run", "--port", str(port),
            "--interval-s", "0.25", "--", sys.executable, SCRIPT, scenario, when, str(port),
        ]  # fmt: skip
    else:
        command = [sys.executable, SCRIPT, scenario, when, str(port)]
    return _ran(command, alloc_conf)


def _judged(r: dict, verdict: str) -> None:
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["raised"], "the scenario did not run out of memory"
    assert r["verdicts"] == {verdict: 1.0}, r
    assert r["seen_after_s"] is not None and r["seen_after_s"] <= WITHIN_S, r


@pytest.mark.parametrize(("scenario", "alloc_conf", "verdict"), CAUSES)
def test_an_oom_right_after_start_gets_its_verdict_within_a_second(scenario, alloc_conf, verdict):
    _judged(at_start(scenario, "after", alloc_conf), verdict)


@pytest.mark.parametrize("when", ["before", "after", "run"])
def test_the_processs_first_allocation_is_judged(when):
    """1 TiB asked as the first allocation: start() before torch is imported, start() once
    CUDA is up (torch.cuda.init(), no allocation), or under `run`."""
    r = at_start("first", when)
    _judged(r, "exhaustion")
    assert r["readings"]["requested"] == 1 << 40, r
    assert r["cuda_up_before_the_oom"] is (when == "after"), r


@pytest.mark.parametrize(("scenario", "alloc_conf", "verdict"), CAUSES[:3])
def test_an_oom_at_start_up_under_run_gets_its_verdict(scenario, alloc_conf, verdict):
    _judged(at_start(scenario, "run", alloc_conf), verdict)
