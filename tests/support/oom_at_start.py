"""OOMs at a server's start-up, judged by the exporter as a user runs it (issue 63 item 1): the
OOM made right after `exporter.start()` returns, as the process's very first CUDA allocation,
and under `gpumem-exporter run`; the verdict read from /metrics, with how long after the OOM
it was first there. One JSON object on stdout. tests/gpu/test_gpu_oom_at_start.py asserts.

    python tests/support/oom_at_start.py SCENARIO WHEN PORT

SCENARIO: one of tests/support/oom_scenarios.py's (its set-up, then its OOM), or `first`:
a 1 TiB request as the first thing the process asks of CUDA. WHEN: `before` (start() before
torch is imported), `after` (start() once CUDA is up, the OOM at once), `run` (no start():
`gpumem-exporter run` injected the agent before this program ran).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCENARIO, WHEN, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])
INTERVAL_S = 0.25
DEADLINE_S = 30.0

if WHEN == "before":
    import exporter

    exporter.start(port=PORT, interval_s=INTERVAL_S)

import torch  # noqa: E402

from tests.support import oom_scenarios  # noqa: E402

oom_at: list[float] = []
cuda_up_before_the_oom: list[bool] = []


def _start_now() -> tuple[Any, Any]:
    """The scenario's own arming, replaced by the exporter as a user starts it."""
    if WHEN == "after":
        import exporter

        handle = exporter.start(port=PORT, interval_s=INTERVAL_S)
        assert handle.error is None, handle.error
    return None, None


def _timed_oom(size: int) -> bool:
    raised = _oom(size)
    oom_at.append(time.monotonic())
    return raised


def _verdicts() -> tuple[dict[str, float], dict[str, float], str]:
    """torch_cuda_ooms_by_verdict_total by verdict and torch_cuda_oom_last_bytes by reading."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5) as response:
        text = response.read().decode()
    verdicts: dict[str, float] = {}
    readings: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "torch_cuda_ooms_by_verdict_total":
                verdicts[sample.labels["verdict"]] = sample.value
            elif sample.name == "torch_cuda_oom_last_bytes":
                readings[sample.labels.get("reading", "?")] = sample.value
    return verdicts, readings, text


def _read_from_metrics(source: Any, armed: Any, raised: bool) -> dict[str, Any]:
    """The verdict as /metrics serves it, polled every 20 ms from the OOM on."""
    seen_after = None
    verdicts: dict[str, float] = {}
    readings: dict[str, float] = {}
    while time.monotonic() - oom_at[-1] < DEADLINE_S:
        try:
            verdicts, readings, _ = _verdicts()
        except OSError:
            verdicts = {}
        if verdicts and "requested" in readings:
            seen_after = time.monotonic() - oom_at[-1]
            break
        time.sleep(0.02)
    return {
        "raised": raised,
        "when": WHEN,
        "verdicts": verdicts,
        "readings": readings,
        "seen_after_s": seen_after,
        "cuda_up_before_the_oom": cuda_up_before_the_oom[-1] if cuda_up_before_the_oom else None,
    }


def first() -> dict[str, Any]:
    """A request no GPU has room for, as the process's first CUDA call of any kind (start()
    after CUDA's initialization, in `after`, is the one exception: it needs CUDA up first)."""
    if WHEN == "after":
        torch.cuda.init()  # up, without an allocation
        _start_now()
    cuda_up_before_the_oom.append(torch.cuda.is_initialized())
    raised = _timed_oom(1 << 40)
    return _read_from_metrics(None, None, raised)


_oom = oom_scenarios._oom
oom_scenarios._arm = _start_now
oom_scenarios._oom = _timed_oom
oom_scenarios._result = _read_from_metrics

if __name__ == "__main__":
    run = first if SCENARIO == "first" else oom_scenarios.SCENARIOS[SCENARIO]
    result = run()
    result["requested_bytes_asked"] = {"first": 1 << 40}.get(SCENARIO)
    print(json.dumps(result, default=str), flush=True)
