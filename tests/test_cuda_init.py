"""exporter.cuda_init on the CPU build of torch: the entry lands in torch.cuda's initialization
queue whether torch was imported before or after, the import watcher leaves no trace, and a
failing callback never reaches torch. That torch then calls it at CUDA's initialization,
before the first allocation goes on, is the GPU tests' (tests/gpu/test_gpu_oom_at_start.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def run(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


QUEUED = """
import torch.cuda as cuda
queued = [c for c, _ in cuda._queued_calls if c is cuda_init._initialized_now]
watching = [f for f in sys.meta_path if isinstance(f, cuda_init._Watcher)]
import inspect
source_ok = "def is_available" in inspect.getsource(cuda.is_available)
"""


@pytest.mark.parametrize("torch_first", [False, True])
def test_the_entry_is_queued_whether_torch_comes_before_or_after(torch_first):
    said = run(
        f"""
        import json, sys
        if {torch_first}:
            import torch
        from exporter import cuda_init
        calls = []
        cuda_init.on_cuda_init(lambda: calls.append("armed"))
        cuda_init.on_cuda_init(lambda: calls.append("second"))
        import torch
        {textwrap.indent(QUEUED, " " * 8).strip()}
        before = list(calls)
        queued[0]()  # what torch's _lazy_init does once the driver is up
        queued[0]()  # and never twice
        print(json.dumps({{"queued": len(queued), "watching": len(watching),
                          "source_ok": source_ok, "before": before, "after": calls}}))
        """
    )
    assert said["queued"] == 1  # one entry, however many callbacks
    assert said["watching"] == 0  # the import watcher took itself off sys.meta_path
    assert said["source_ok"]  # torch.cuda's own loader is back (inspect, linecache)
    assert said["before"] == [] and said["after"] == ["armed", "second"]


def test_a_failing_callback_never_reaches_torch_and_the_others_still_run():
    said = run(
        """
        import json, torch
        from exporter import cuda_init
        calls = []
        def broken():
            raise RuntimeError("a bug")
        cuda_init.on_cuda_init(broken)
        cuda_init.on_cuda_init(lambda: calls.append("ran"))
        cuda_init._initialized_now()
        print(json.dumps({"calls": calls}))
        """
    )
    assert said["calls"] == ["ran"]


@pytest.mark.slow
def test_start_queues_the_agents_arming_before_torch_is_imported():
    """exporter.start() first, torch after (the README's order, and `run`'s): the probe's
    entry is queued at torch's import; torch's initialization then arms the probe (its
    actions and OOM observer) on the thread that initializes, with no tick between."""
    said = run(
        """
        import json, sys
        import exporter
        from exporter import cuda_init
        handle = exporter.start(port=0, interval_s=60)
        import torch
        import torch.cuda as cuda
        queued = [c for c, _ in cuda._queued_calls if c is cuda_init._initialized_now]
        agent = handle._link.agent
        before = agent.actions is not None
        queued[0]()
        after = agent.actions is not None and agent.actions.oom_capture is not None
        exporter.stop()
        print(json.dumps({"queued": len(queued), "before": before, "after": after}))
        """
    )
    assert said == {"queued": 1, "before": False, "after": True}


@pytest.mark.slow
def test_a_stopped_probe_is_not_armed():
    said = run(
        """
        import json, torch
        import exporter
        from exporter import cuda_init
        handle = exporter.start(port=0, interval_s=60)
        agent = handle._link.agent
        exporter.stop()
        cuda_init._initialized_now()
        print(json.dumps({"armed": agent.actions is not None}))
        """
    )
    assert said["armed"] is False
