"""HTTP: the FastAPI routes and the uvicorn server that runs them in a thread of its own.

`/metrics`, `/healthz` and `/readyz` are open (Prometheus and kubelet probes need no token).
The routes are added to a given app so that `exporter.attach()` can put them on the host's own
FastAPI app as well.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import choose_encoder
from starlette.routing import BaseRoute

from exporter.exposition import ExpositionCache, RenderFailed
from exporter.health import health
from exporter.http.access import NO_ADMIN, AccessCheck, AdminPaths, is_loopback
from exporter.http.admin import add_admin_routes
from exporter.http.guard import AnswerWatch, Connections, guarded
from exporter.http.page import add_page_routes
from exporter.http.served import Served
from exporter.http.tls import TlsAdmission
from exporter.internals import QuietServer
from exporter.sigpipe import block_sigpipe_in_this_thread
from exporter.webconfig.security import WebSecurity

log = logging.getLogger(__name__)
Endpoint = Callable[..., Awaitable[Response]]


class ServerStartError(RuntimeError):
    """The HTTP server could not start (e.g. port in use); str() says why in one line."""


def metrics_response(exposition: ExpositionCache, accept: str, accept_encoding: str) -> Response:
    """The latest sample's exposition in the format asked for (OpenMetrics if asked for)."""
    try:
        body = exposition.body(accept, accept_encoding)
    except RenderFailed as exc:  # counted and on /healthz (exporter.exposition)
        return Response(
            content=f"gpumem-exporter could not render /metrics: {exc}\n",
            status_code=500,
            media_type="text/plain; charset=utf-8",
        )
    headers = {"Content-Encoding": "gzip"} if body.gzipped else None
    return Response(content=body.data, media_type=body.content_type, headers=headers)


def health_response(runtime: Served) -> JSONResponse:
    """/healthz's answer (exporter.health; the route's docstring says what it means)."""
    exposition = runtime.exposition
    healthy, body = health(
        runtime.sampler,
        runtime.config.stale_threshold_s,
        runtime.mode,
        runtime.silent_processes(),
        render_failure=exposition.failures.last if exposition is not None else None,
    )
    return JSONResponse(body, status_code=200 if healthy else 503)


def readiness_response(runtime: Served) -> JSONResponse:
    """/readyz's answer (the route's docstring says what it means)."""
    reason = runtime.not_ready()
    body: dict[str, object] = {"ready": reason is None}
    if reason is not None:
        body["reason"] = reason
    return JSONResponse(body, status_code=200 if reason is None else 503)


def get_and_head(app: FastAPI, path: str) -> Callable[[Endpoint], Endpoint]:
    """An open route's GET, in the API's schema, and its HEAD beside it, out of it. One route
    of both methods is two operations of one ID in the schema, which FastAPI warns of at
    every /openapi.json."""

    def register(endpoint: Endpoint) -> Endpoint:
        app.get(path, tags=["exporter"])(endpoint)
        app.head(path, include_in_schema=False)(endpoint)
        return endpoint

    return register


def add_routes(app: FastAPI, runtime: Served, *, include_metrics: bool = True) -> list[BaseRoute]:
    """The open routes, and the token-protected admin API (exporter.http.admin).

    On the exporter's own server the open routes' GET and HEAD are answered before they reach
    this app (OpenRoutes), by the same functions: these serve attach()'s host app and the
    open routes' other methods (405). Returned: the admin routes (exporter.http.access)."""
    registry, exposition = runtime.registry, runtime.exposition
    admin_routes = add_admin_routes(app, runtime.admin)
    if include_metrics:

        @get_and_head(app, "/metrics")
        async def metrics(request: Request) -> Response:
            """Prometheus exposition of the latest sample (OpenMetrics if asked for)."""
            # Rendered on the event loop thread rather than handed to a worker thread: under
            # a Python-bound server every thread hand-off waits for the GIL, which is what
            # dominated scrape latency in bench/scrape_latency.py.
            accept = request.headers.get("accept", "")
            if exposition is None:  # not our registry (attach()): render it as it is now
                encoder, content_type = choose_encoder(accept)
                return Response(content=encoder(registry), media_type=content_type)
            return metrics_response(exposition, accept, request.headers.get("accept-encoding", ""))

    # Health and readiness run on the event loop, never in the thread pool: admin calls that
    # wait for a stopped process hold the pool's 40 threads, and a probe queued behind them
    # (57 s, measured) would restart a healthy pod. Both read the sampler's state: no I/O.
    # HEAD as node_exporter answers it (round 4: 405 here): a load balancer's or a monitor's
    # check that asks for the head only. uvicorn sends no body to a HEAD.
    @get_and_head(app, "/healthz")
    async def healthz() -> JSONResponse:
        """200 while fresh samples come from working sources; else 503 and why: "starting"
        (no sample yet), "stale" (the sampler stopped producing them), "failing" (samples come
        but carry nothing: every source failed its last 3 reads, or the demo's replay did;
        `failing_sources` names them with their last error). One source failing among
        working ones (NVML on a host without a GPU) stays "ok", as Sampler.failing_sources
        explains: gpumem_exporter_source_up shows it instead."""
        return health_response(runtime)

    @get_and_head(app, "/readyz")
    async def readyz() -> JSONResponse:
        """200 once the first sample has been taken; the node daemon also needs a GPU that
        answers NVML (runtime.readiness): otherwise 503 with the reason."""
        return readiness_response(runtime)

    return admin_routes


# path -> the answer, from the request's headers (lower-case names, as ASGI gives them).
Routes = Mapping[str, Callable[[dict[bytes, bytes]], Response]]


@dataclass(frozen=True)
class AroundTheApp:
    """What HttpServer serves around an app (create_app, create_health_app): the routes it
    answers before the app (OpenRoutes), the admin routes the access check knows by
    declaration, and the web config it serves with (TLS, basic auth, headers). Kept on the app
    as its one typed record (`around(app)`), so that a wrapper of the app can hand it on."""

    open_routes: Routes = field(default_factory=dict)
    admin: AdminPaths = NO_ADMIN
    web: WebSecurity | None = None


def around(app: Any) -> AroundTheApp:
    """The app's record (create_app's), or nothing around an app made elsewhere."""
    found = getattr(getattr(app, "state", None), "around", None)
    return found if isinstance(found, AroundTheApp) else AroundTheApp()


def create_app(runtime: Served) -> FastAPI:
    app = FastAPI(
        title="gpumem-exporter",
        description="PyTorch CUDA allocator, NVML and host memory metrics for Prometheus.",
        docs_url=None,  # the Swagger page loads its scripts from a CDN: off for air-gapped use
        redoc_url=None,
    )
    # The access check (HttpServer) knows the admin routes by this declaration.
    admin = AdminPaths(add_routes(app, runtime))
    add_page_routes(app, runtime)  # here, not in add_routes: attach() must not take the host's `/`
    # What HttpServer answers before the app (OpenRoutes), by the routes' own functions.
    app.state.around = AroundTheApp(open_routes(runtime), admin, runtime.web)
    return app


def create_health_app(runtime: Served) -> FastAPI:
    """Only /healthz and /readyz, for a port of their own (health_port): plain HTTP where the
    main port asks for a client certificate, which the kubelet's probes cannot show. What
    they say (a sample's age, failing sources, readiness) is no secret; nothing else is
    served there."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    def healthz() -> Response:
        return health_response(runtime)

    @app.get("/readyz")
    def readyz() -> Response:
        return readiness_response(runtime)

    app.state.around = AroundTheApp(
        {path: route for path, route in open_routes(runtime).items() if path != "/metrics"}
    )
    return app


def open_routes(runtime: Served) -> Routes:
    exposition = runtime.exposition
    routes: dict[str, Callable[[dict[bytes, bytes]], Response]] = {
        "/healthz": lambda headers: health_response(runtime),
        "/readyz": lambda headers: readiness_response(runtime),
    }
    if exposition is not None:
        routes["/metrics"] = lambda headers: metrics_response(
            exposition,
            headers.get(b"accept", b"").decode("latin-1"),
            headers.get(b"accept-encoding", b"").decode("latin-1"),
        )
    return routes


class OpenRoutes:
    """ASGI: GET and HEAD of the open routes answered by their functions, without the app.
    Prometheus scrapes and the kubelet probes for as long as the server runs, and the app's
    round trip (Starlette's routing and middleware, FastAPI's dependency solving) cost 4x the
    answer's own work (docs/performance.md). Everything else goes to the app. It sits inside
    the access check (exporter.http.access), which every request passes."""

    def __init__(self, app: Any, routes: Routes) -> None:
        self.app, self.routes = app, routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        await route(dict(scope["headers"]))(scope, receive, send)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before starting uvicorn so that a taken port is a clear error, not a thread exit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # accepted connections inherit it. Without it every response after the first on a
    # kept-alive connection (Prometheus keeps its connection) waited ~40 ms for the peer's
    # delayed ACK (Nagle), because uvicorn writes the headers and the body separately.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # A burst of clients (300 at once, measured) must queue, not see dropped SYNs: the
        # guard answers the ones beyond its connection cap with 503 (exporter.http.guard).
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ServerStartError(f"port {port} on {host} is already in use") from None
        raise ServerStartError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(False)
    return sock


def _protocol_factory(
    web: WebSecurity | None, admission: TlsAdmission, connections: Connections
) -> Callable[..., asyncio.Protocol]:
    """What uvicorn calls for each accepted connection. With TLS on, the connection waits as a
    socket for its first bytes, then the HTTP protocol sits on asyncio's own TLS protocol
    (exporter.http.tls), with the context in force when it was accepted: a rotated
    certificate (or client CA) is used from the next connection on."""

    def create(**kwargs: Any) -> asyncio.Protocol:
        context = web.context_for_connection() if web is not None else None
        if context is None:
            return guarded(connections, web, **kwargs)
        return admission.arriving(context, lambda: guarded(connections, web, **kwargs))

    return create


HTTP_THREAD = "gpumem-http"


class _NotFromOurThread(logging.Filter):
    """Drops the records uvicorn's server logs from the exporter's HTTP thread."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != HTTP_THREAD


_NOT_FROM_OUR_THREAD = _NotFromOurThread()  # one filter, added once however often started


class HttpServer:
    """uvicorn on a pre-bound socket, in the calling thread (`run`) or a daemon thread; the
    app's open routes (`around(app)`) are answered before the app (OpenRoutes)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.sock = bind_socket(host, port)
        self.host = host
        self.port = self.sock.getsockname()[1]
        # The web config (TLS, basic auth, headers, rate limit), where create_app was given one.
        # Without a file the web config's rules are not checked per request.
        parts = around(app)
        web = parts.web
        self.web = web if web is not None and web.path else None
        # The open connections as the guard sees them (exporter.http.guard).
        self.connections = Connections()
        # Every request passes the one access check, the open routes' too; the guard's ASGI
        # side sees every answer start and end.
        served = AnswerWatch(
            AccessCheck(
                OpenRoutes(app, parts.open_routes),
                loopback_only=is_loopback(host),  # every Host must then be a loopback name
                web=self.web,
                admin=parts.admin,
            ),
            self.connections,
        )
        self._admission = TlsAdmission()
        config = uvicorn.Config(
            served,
            # Slow or hostile clients cannot hold connections (exporter.http.guard); TLS
            # with the context in force at each handshake (_protocol_factory).
            http=_protocol_factory(self.web, self._admission, self.connections),  # type: ignore[arg-type]
            log_config=None,  # never reconfigure the host process's logging
            # True, because False makes uvicorn empty the process-wide "uvicorn.access"
            # logger: a host served by uvicorn would lose its own access log. Ours is off
            # on each connection's protocol (exporter.internals.quiet_http_protocol).
            access_log=True,
            # The Date header is each answer's (exporter.http.guard.AnswerWatch): uvicorn's
            # is refreshed by a timer that wakes its loop ten times a second.
            date_header=False,
            # No websockets: a guarded connection is never handed to another protocol.
            ws="none",
            # asyncio's own loop, never uvloop: uvicorn's "auto" takes uvloop wherever it is
            # installed (vLLM and `uvicorn[standard]` install it), and the guard is built on
            # asyncio's transports; under uvloop every connection failed in connection_made.
            # The server runs on a loop of its own (its thread, or `run`'s), not the host's.
            loop="asyncio",
            lifespan="off",
            timeout_graceful_shutdown=2,
            # No proxy stands before this server: the peer's address is the client's. Trusted
            # from 127.0.0.1 (uvicorn's default), X-Forwarded-For let any local process name
            # any address in the audit trail and take another client's rate-limit bucket.
            proxy_headers=False,
        )
        self._server = QuietServer(
            config,
            on_shutdown=self._admission.close_all,
            after_shutdown=self.connections.abort_all,
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.web is not None and self.web.tls else "http"
        return f"{scheme}://{host}:{self.port}"

    def run(self) -> None:
        """Serve in this thread until stopped (uvicorn handles SIGINT/SIGTERM in the main one)."""
        self._server.run(sockets=[self.sock])

    def start(self, on_exit: Callable[[], None] | None = None) -> None:
        # uvicorn's server logs its start and stop on the process-wide "uvicorn.error" logger:
        # in a host served by uvicorn, "Started server process" would show twice.
        logging.getLogger("uvicorn.error").addFilter(_NOT_FROM_OUR_THREAD)

        def target() -> None:
            block_sigpipe_in_this_thread()  # a client gone mid-answer must not kill a host
            try:
                self.run()
            except BaseException as exc:  # a SystemExit here must not look like a host crash
                log.error("gpumem-exporter HTTP server stopped: %s", exc)
            if on_exit is not None:
                on_exit()

        self._thread = threading.Thread(target=target, name=HTTP_THREAD, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.exit()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.sock.close()
