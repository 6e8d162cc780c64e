"""The one-line embedding: `exporter.start()` in an inference server, or `exporter.attach(app)`.

Promise to the host process: after arguments are validated (ConfigError for bad settings),
nothing raised inside the exporter reaches the caller. A taken port or a missing NVML is
logged in one line and reported on the handle; the sampler keeps running.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from exporter.config import Config, load_config
from exporter.detectors import Listener as AlertListener
from exporter.http.server import HttpServer, ServerStartError, add_routes, create_app
from exporter.run import agent
from exporter.run.agent import RUN_DIR_ENV
from exporter.runtime import Runtime, build_runtime, live_sources
from exporter.sampler import Listener, Sampler
from exporter.trace import TraceWriter

log = logging.getLogger("exporter")

_lock = threading.Lock()
_handle: Handle | None = None


@dataclass
class Handle:
    """A running embedded exporter. `stop()` is safe to call more than once."""

    runtime: Runtime
    url: str | None = None
    error: str | None = None
    recorder: TraceWriter | None = None
    _http: HttpServer | None = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)

    @property
    def config(self) -> Config:
        return self.runtime.config

    @property
    def sampler(self) -> Sampler:
        return self.runtime.sampler

    @property
    def registry(self) -> CollectorRegistry:
        return self.runtime.registry

    @property
    def unavailable(self) -> dict[str, str]:
        """Sources with nothing to read on this host, and why (e.g. {"nvml": "NVML Shared
        Library Not Found"} on a CPU-only host): no data, unlike `error`."""
        return self.sampler.unavailable_sources()

    def stop(self) -> None:
        global _handle
        with _lock:
            if self._stopped:
                return
            self._stopped = True
            if _handle is self:
                _handle = None
        try:
            if self._http is not None:
                self._http.stop()
            self.sampler.stop()
            self.registry.unregister(self.runtime.collector)
            if self.recorder is not None:
                path = self.recorder.close()
                log.info(
                    "gpumem-exporter: trace of %d samples written to %s", self.recorder.count, path
                )
        except Exception as exc:
            log.error("gpumem-exporter: error while stopping: %s", exc)


def start(
    *,
    port: int | None = None,
    host: str | None = None,
    interval_s: float | None = None,
    labels: dict[str, str] | None = None,
    serve_http: bool = True,
    record_to: str | Path | None = None,
    listeners: list[Listener] | None = None,
    on_alert: AlertListener | None = None,
    **settings: Any,
) -> Handle:
    """Start the sampler thread and (unless serve_http=False) the HTTP server thread.

    Idempotent: a second call returns the running handle. `record_to` also writes every sample
    to a trace file that `gpumem-exporter demo --trace FILE` replays. `on_alert(event)` is
    called (on the sampler thread) when an in-process alert starts firing or clears.
    """
    global _handle
    with _lock:
        if _handle is not None:
            log.debug("gpumem-exporter already started; returning the running handle")
            return _handle
        config = load_config(port=port, host=host, interval_s=interval_s, labels=labels, **settings)
        if os.environ.get(RUN_DIR_ENV):
            return _under_run(config)
        if config.port_per_local_rank and os.environ.get("LOCAL_RANK", "").isdigit():
            # The explicit rule for one exporter per rank without `run`: base port + rank.
            config = dataclasses.replace(config, port=config.port + int(os.environ["LOCAL_RANK"]))
        all_listeners = list(listeners or [])
        recorder = None
        if record_to is not None:
            # Live: a server that crashes keeps what was recorded up to its last sample.
            recorder = TraceWriter(record_to, meta={"recorded_by": "exporter.start"}, live=True)
            all_listeners.append(recorder)
        runtime = _runtime(config, on_alert, listeners=all_listeners)
        handle = Handle(runtime, recorder=recorder)
        runtime.sampler.start()
        if serve_http:
            _serve(runtime, handle)
        _handle = handle
        return handle


def _runtime(config: Config, on_alert: AlertListener | None, **options: Any) -> Runtime:
    """The in-process runtime that start() and attach() share: this machine's sources."""
    return build_runtime(
        config,
        mode="embedded",
        sources=live_sources(config, torch=True),
        on_alert=[on_alert] if on_alert else [],
        **options,
    )


def _under_run(config: Config) -> Handle:
    """Under `gpumem-exporter run` the agent of this process already reports to the one
    endpoint of the pod, and owns this process's allocator features (OOM capture, history,
    remediation, with the launcher's settings): no port of our own (so workers never
    collide), no second sampler, nothing armed twice."""
    global _handle
    agent.start_agent()
    idle = dataclasses.replace(config, remediate=False, oom_snapshot=False, history_max_entries=0)
    _handle = Handle(build_runtime(idle, mode="embedded", sources=[]))
    log.info(
        "gpumem-exporter: running under `gpumem-exporter run`; this process reports "
        "to the launcher's endpoint"
    )
    return _handle


def _serve(runtime: Runtime, handle: Handle) -> None:
    config = runtime.config
    try:
        app = create_app(runtime)
        http = HttpServer(app, config.host, config.port)
    except ServerStartError as exc:
        handle.error = str(exc)
        log.error(
            "gpumem-exporter: %s; metrics are not served over HTTP (set GPUMEM_PORT or port=...)",
            exc,
        )
        return
    except Exception as exc:
        handle.error = f"HTTP server failed to start: {exc}"
        log.error("gpumem-exporter: %s", handle.error)
        return
    http.start()
    handle._http = http
    handle.url = http.url
    log.info("gpumem-exporter serving %s/metrics", http.url)


def attach(
    app: Any,
    *,
    registry: CollectorRegistry = REGISTRY,
    interval_s: float | None = None,
    labels: dict[str, str] | None = None,
    on_alert: AlertListener | None = None,
    **settings: Any,
) -> Handle:
    """Mount /healthz, /readyz (and /metrics if the app has none) on the host's FastAPI app.

    Metrics go into `registry` (the default prometheus_client registry unless told), so a
    server that already serves /metrics from it, like vLLM, shows them without a new port.
    """
    global _handle
    with _lock:
        if _handle is not None:
            return _handle
        config = load_config(interval_s=interval_s, labels=labels, **settings)
        runtime = _runtime(config, on_alert, registry=registry)
        paths = {getattr(route, "path", None) for route in app.routes}
        add_routes(app, runtime, include_metrics="/metrics" not in paths)
        runtime.sampler.start()
        _handle = Handle(runtime)
        return _handle


def stop() -> None:
    """Stop the running embedded exporter, if any."""
    handle = _handle
    if handle is not None:
        handle.stop()
