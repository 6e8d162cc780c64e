"""The one-line embedding: `exporter.start()` in an inference server, or `exporter.attach(app)`.

`start()` leaves only an agent in the serving process (exporter.transport.agent: the
allocator's C call and one packed record per tick, sent without blocking) and starts, or joins,
one helper process for the port that does everything else (exporter.helper): the process pays
the agent's tick (exporter.probe), never a render, a detector or an HTTP exchange. What hands
the host's own code the samples runs in-process instead, as before: `serve_http=False`,
`listeners`, `on_alert`, `record_to`, `helper=False`, and `attach()` (its routes are the host
app's).

Promise to the host process: after arguments are validated (ConfigError for bad settings),
nothing raised inside the exporter reaches the caller. A taken port or a missing NVML is
logged in one line and reported on the handle; the agent (or the sampler) keeps running.

One exporter per process: a second start() or attach() returns the running handle, and says
in a warning which of the settings it asked for the running exporter does not have.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.config import Config, load_config
from exporter.helper.link import HelperLink
from exporter.run import agent
from exporter.run.agent import RUN_DIR_ENV

# The in-process exporter's modules (the web stack, prometheus_client, the sampler) are
# imported where it starts: a process with a helper loads the agent's modules only.
if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from exporter.detectors import Listener as AlertListener
    from exporter.http.server import HttpServer
    from exporter.multiprocess import MultiprocessBridge
    from exporter.runtime import Runtime
    from exporter.sampler import Listener, Sampler
    from exporter.trace import TraceWriter

log = logging.getLogger("exporter")

_lock = threading.Lock()
_handle: Handle | None = None
# Settings whose values a warning never shows.
_SECRET = frozenset({"admin_token"})


@dataclass
class Handle:
    """A running embedded exporter. `stop()` is safe to call more than once.

    With a helper (start()'s default) this process has no runtime: `sampler` and `registry`
    are the helper's, not here; `unavailable` asks the helper."""

    runtime: Runtime | None
    url: str | None = None
    error: str | None = None
    recorder: TraceWriter | None = None
    # Under PROMETHEUS_MULTIPROC_DIR (attach()): what publishes the series to the app's
    # MultiProcessCollector.
    bridge: MultiprocessBridge | None = None
    _http: HttpServer | None = field(default=None, repr=False)
    _link: HelperLink | None = field(default=None, repr=False)
    _settings: Config | None = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)
    # What the call that started it asked for, to compare a second call with.
    _call: str = field(default="start", repr=False)
    _asked: Config | None = field(default=None, repr=False)
    _options: dict[str, Any] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        # Not the dataclass's: that would print the whole runtime (sampler, registry, ...).
        state = (
            "stopped" if self._stopped else ("error: " + self.error if self.error else "running")
        )
        return f"<gpumem-exporter {self._call} {state} url={self.url}>"

    @property
    def warning(self) -> str | None:
        """What a joined helper runs with otherwise than this process asked (its settings
        are in force, not these), else None."""
        return self._link.warning if self._link is not None else None

    @property
    def config(self) -> Config:
        if self.runtime is not None:
            return self.runtime.config
        assert self._settings is not None
        return self._settings

    @property
    def sampler(self) -> Sampler:
        return self._in_process().sampler

    @property
    def registry(self) -> CollectorRegistry:
        return self._in_process().registry

    def _in_process(self) -> Runtime:
        if self.runtime is None:
            raise AttributeError(
                "this exporter runs in its helper process: no sampler or registry here "
                "(exporter.start(helper=False) keeps them in this process)"
            )
        return self.runtime

    @property
    def unavailable(self) -> dict[str, str]:
        """Sources with nothing to read on this host, and why (e.g. {"nvml": "NVML Shared
        Library Not Found"} on a CPU-only host): no data, unlike `error`."""
        if self.runtime is not None:
            return self.sampler.unavailable_sources()
        return self._link.unavailable() if self._link is not None else {}

    def stop(self) -> None:
        global _handle
        with _lock:
            if self._stopped:
                return
            self._stopped = True
            if _handle is self:
                _handle = None
        try:
            if self._link is not None:
                self._link.stop()
            if self.runtime is None:
                return
            if self._http is not None:
                self._http.stop()
            self.sampler.stop()
            if self.bridge is not None:
                self.bridge.close()
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
    helper: bool = True,
    **settings: Any,
) -> Handle:
    """Start this process's agent and the helper that serves `port` (or join the one that
    does: several workers with one port give one endpoint).

    In-process instead (a sampler thread, and an HTTP thread unless serve_http=False) where
    the caller's code takes the samples: `listeners`, `on_alert(event)` (called on the sampler
    thread when an alert starts firing or clears), `record_to` (every sample also written to a
    trace file that `gpumem-exporter demo --trace FILE` replays), or `helper=False`.

    Idempotent: a second call returns the running handle (and a warning names what it asked
    for that the running exporter does not have).
    """
    global _handle
    asked = {"port": port, "host": host, "interval_s": interval_s, "labels": labels, **settings}
    options = {
        "serve_http": serve_http,
        "record_to": None if record_to is None else str(record_to),
        "listeners": tuple(id(x) for x in listeners) if listeners else None,
        "on_alert": None if on_alert is None else id(on_alert),
        "helper": helper,
    }
    with _lock:
        config = load_config(**asked)
        if _handle is not None:
            return _already_running(_handle, "start", config, asked, options)
        if os.environ.get(RUN_DIR_ENV):
            return _remember(_under_run(config), "start", config, options)
        if config.port_per_local_rank and os.environ.get("LOCAL_RANK", "").isdigit():
            # The explicit rule for one exporter per rank without `run`: base port + rank.
            config = dataclasses.replace(config, port=config.port + int(os.environ["LOCAL_RANK"]))
        in_process = not helper or not serve_http or listeners or on_alert or record_to
        if not in_process:
            _handle = _remember(_with_helper(config), "start", config, options)
            return _handle
        all_listeners = list(listeners or [])
        recorder = None
        if record_to is not None:
            # Live: a server that crashes keeps what was recorded up to its last sample.
            from exporter.trace import TraceWriter

            recorder = TraceWriter(record_to, meta={"recorded_by": "exporter.start"}, live=True)
            all_listeners.append(recorder)
        runtime = _runtime(config, on_alert, listeners=all_listeners)
        handle = Handle(runtime, recorder=recorder)
        runtime.sampler.start()
        if serve_http:
            _serve(runtime, handle)
        _handle = _remember(handle, "start", config, options)
        return handle


def _remember(handle: Handle, call: str, config: Config, options: dict[str, Any]) -> Handle:
    handle._call, handle._asked, handle._options = call, config, options
    return handle


def _already_running(
    handle: Handle, call: str, config: Config, asked: dict[str, Any], options: dict[str, Any]
) -> Handle:
    """Return the running handle. What this call asked for and the running exporter does not
    have (settings it passed, options of the call) is named in a warning: running with other
    settings than asked, silently, hides a mistake. A token's value is never shown."""
    running = handle._asked or handle.config
    differences = []
    if handle._call != call:
        differences.append(f"the running exporter was started by exporter.{handle._call}()")
    for name, value in asked.items():
        if value is not None and getattr(config, name) != getattr(running, name):
            differences.append(_difference(name, getattr(running, name), getattr(config, name)))
    for name, value in options.items():
        if handle._call == call and value is not None and value != handle._options.get(name):
            differences.append(_difference(name, handle._options.get(name), value))
    if differences:
        log.warning(
            "gpumem-exporter: exporter.%s() called again; it returns the running exporter, "
            "which keeps its own settings (stop() it first to change them): %s",
            call,
            "; ".join(differences),
        )
    else:
        log.debug("gpumem-exporter already started; returning the running handle")
    return handle


def _difference(name: str, running: Any, asked: Any) -> str:
    if name in _SECRET or name in ("listeners", "on_alert", "app", "registry"):
        return f"{name} differs"  # a secret, or an object whose repr says nothing
    return f"{name} is {running!r}, not {asked!r}"


def _runtime(config: Config, on_alert: AlertListener | None, **options: Any) -> Runtime:
    """The in-process runtime that start() and attach() share: this machine's sources."""
    from exporter.runtime import build_runtime, sources_for

    return build_runtime(
        config,
        mode="embedded",
        sources=sources_for("embedded", config),
        on_alert=[on_alert] if on_alert else [],
        **options,
    )


def _with_helper(config: Config) -> Handle:
    """The agent here, everything else in the helper for the port (joined or started). What
    blocks the helper (a taken port, a refused folder, a helper that closes the agent's
    connection) is on the handle and logged once; the link tries again until it is served."""
    handle = Handle(None, _settings=config)

    def served(url: str) -> None:  # a helper again, or at last (a sidecar's)
        handle.url, handle.error = url, None

    def blocked(reason: str) -> None:
        handle.error = reason

    link = HelperLink(config, on_url=served, on_error=blocked)
    handle._link = link
    try:
        url = link.start()
    except Exception as exc:  # a bug: never into the host
        handle.error = f"the link to the helper failed to start: {type(exc).__name__}: {exc}"
        log.error("gpumem-exporter: %s", handle.error)
        return handle
    if url is not None:
        handle.url = url
        log.info("gpumem-exporter serving %s/metrics from its helper process", url)
    return handle


def _under_run(config: Config) -> Handle:
    """Under `gpumem-exporter run` the agent of this process already reports to the one
    endpoint of the pod, and owns this process's allocator features (OOM capture, history,
    remediation, with the launcher's settings): no port of our own (so workers never
    collide), no second sampler, nothing armed twice."""
    global _handle
    agent.start_agent()
    # Nor does it serve: the launcher's web config and admin identities are the launcher's.
    idle = dataclasses.replace(
        config,
        remediate=False,
        oom_snapshot=False,
        history_max_entries=0,
        web_config_file=None,
        admin_auth=("token",),
    )
    from exporter.runtime import build_runtime

    _handle = Handle(build_runtime(idle, mode="embedded", sources=[]))
    log.info(
        "gpumem-exporter: running under `gpumem-exporter run`; this process reports "
        "to the launcher's endpoint"
    )
    return _handle


def _serve(runtime: Runtime, handle: Handle) -> None:
    from exporter.http.server import ServerStartError

    try:
        http = runtime.server()
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
    registry: CollectorRegistry | None = None,
    interval_s: float | None = None,
    labels: dict[str, str] | None = None,
    on_alert: AlertListener | None = None,
    **settings: Any,
) -> Handle:
    """Mount /healthz, /readyz (and /metrics if the app has none) on the host's FastAPI app.

    Metrics go into `registry` (the default prometheus_client registry unless told), so a
    server that already serves /metrics from it shows them without a new port. With
    PROMETHEUS_MULTIPROC_DIR set (vLLM, apps with several workers), whose /metrics shows only
    that folder's files, they are also written there on every sample
    (exporter.multiprocess), each process's series labelled with its `pid`.
    """
    from prometheus_client import REGISTRY

    from exporter.http.server import add_routes
    from exporter.multiprocess import MultiprocessBridge, multiprocess_dir
    from exporter.runtime import MetricNameClash

    registry = REGISTRY if registry is None else registry
    global _handle
    asked = {"interval_s": interval_s, "labels": labels, **settings}
    options = {
        "app": id(app),
        "registry": id(registry),
        "on_alert": None if on_alert is None else id(on_alert),
    }
    with _lock:
        config = load_config(**asked)
        if _handle is not None:
            return _already_running(_handle, "attach", config, asked, options)
        if config.web_config_file:
            # The host's server owns the connection (TLS, and who may scrape): ours has none.
            log.warning(
                "gpumem-exporter: attach() serves on the host app, whose server owns TLS and "
                "authentication: web_config_file %s is not used",
                config.web_config_file,
            )
            config = dataclasses.replace(config, web_config_file=None)
        try:
            runtime = _runtime(config, on_alert, registry=registry)
        except MetricNameClash as exc:
            # Nothing registered, nothing started: the host's metrics stay as they were.
            log.error("gpumem-exporter: attach() refused: %s", exc)
            return Handle(None, error=str(exc), _settings=config, _call="attach")
        paths = {getattr(route, "path", None) for route in app.routes}
        add_routes(app, runtime, include_metrics="/metrics" not in paths)
        handle = Handle(runtime)
        directory = multiprocess_dir()
        if directory is not None:
            handle.bridge = MultiprocessBridge(
                runtime.collector.collect, directory, interval_s=config.interval_s
            )
            runtime.sampler.listeners.append(handle.bridge)
            atexit.register(handle.bridge.close)  # a worker that exits takes its series along
            log.info(
                "gpumem-exporter: PROMETHEUS_MULTIPROC_DIR is set: publishing to %s for the "
                "app's MultiProcessCollector",
                directory,
            )
        runtime.sampler.start()
        _handle = _remember(handle, "attach", config, options)
        return _handle


def stop() -> None:
    """Stop the running embedded exporter, if any."""
    handle = _handle
    if handle is not None:
        handle.stop()


def _after_fork_in_child() -> None:
    # A child forked after start() (a pre-forking server) has no agent thread: it lets go of
    # the parent's connection, and its own start() joins the helper anew.
    global _handle
    handle = _handle
    if handle is not None and handle._link is not None:
        handle._link.forget()
        _handle = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
