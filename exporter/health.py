"""Whether the exporter is healthy, and why not: what /healthz says, from the sampler's state
alone (no I/O: the kubelet's probes are answered on the event loop)."""

from __future__ import annotations

from exporter.sampler import Sampler


def health(
    sampler: Sampler,
    stale_after_s: float,
    mode: str,
    silent: list[str] | None = None,
    render_failure: str | None = None,
) -> tuple[bool, dict[str, object]]:
    """(healthy, the body): "ok" while fresh samples come from working sources; "starting"
    (no sample yet), "stale" (the sampler stopped producing them) or "failing" (every source
    failed its last reads; Sampler.failing_sources) otherwise, with the failing sources, the
    unavailable ones and, under `run`, the silent processes named. A /metrics answer that
    failed to render (its last render, `render_failure`) is "failing" too."""
    age = sampler.sample_age_s()
    failing = sampler.failing_sources()
    if age is None:
        status = "starting"
    elif age > stale_after_s:
        status = "stale"
    else:
        status = "failing" if failing or render_failure else "ok"
    body: dict[str, object] = {
        "status": status,
        "mode": mode,
        "sample_age_s": None if age is None else round(age, 3),
        "stale_after_s": stale_after_s,
    }
    unavailable = sampler.unavailable_sources()
    if unavailable:  # no data here, and why: not a failure
        body["unavailable_sources"] = unavailable
    if silent:  # `run`: a stopped or hung process (/readyz is 503 meanwhile)
        body["silent_processes"] = silent
    if render_failure:
        body["render_failure"] = render_failure
    if failing:
        body["failing_sources"] = {
            name: {"failed_reads": status.failed_reads, "last_error": status.last_error}
            for name, status in failing.items()
        }
    return status == "ok", body
