"""The token-protected admin API: snapshots, empty_cache, history, peak reset, stats.

Every route answers JSON errors with a clear `detail`: 401 without a valid bearer token, 403
when no token is configured (admin actions are off), 413 for bodies over 16 KiB, 422 for
invalid input, 409 when the action is not possible right now (CUDA not initialized, a capture
in progress), 429 with Retry-After for empty_cache within its cooldown, 501 where the backend
cannot do it (cudaMallocAsync has no snapshots). Never a 500 for a user's request. Slow work
(empty_cache, snapshots) runs in worker threads, off the event loop.
"""

from __future__ import annotations

import hmac
import inspect
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from exporter.actions import Actions, ActionUnavailable
from exporter.config import Config, ConfigError
from exporter.detectors import Detectors
from exporter.sampler import Sampler
from exporter.snapshots import SnapshotInfo

if TYPE_CHECKING:
    from exporter.aggregator import Aggregator

log = logging.getLogger("exporter.admin")

MAX_BODY_BYTES = 16 * 1024
DISABLED = (
    "admin actions are disabled: set GPUMEM_ADMIN_TOKEN or GPUMEM_ADMIN_TOKEN_FILE "
    "(admin_token= / admin_token_file=) to enable them"
)
VIEW_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
)
REPLAY_NOTE = "replay: answered from data recorded on a real GPU; nothing was changed"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SnapshotRequest(_Body):
    record_s: float | None = Field(
        None,
        gt=0,
        le=600,
        description="Record allocation history for this many seconds, then dump (202).",
    )
    max_entries: int = Field(
        100_000, ge=1, le=1_000_000, description="History ring buffer size while recording."
    )
    stacks: Literal["python", "all"] = Field(
        "python", description="Stack frames to record: python only, or python and C++."
    )
    context: Literal["all", "alloc", "state"] = "all"
    pid: int | None = Field(None, ge=1, description="Under gpumem-exporter run: only this process.")
    rank: int | None = Field(None, ge=0, description="Under gpumem-exporter run: only this rank.")


class EmptyCacheRequest(_Body):
    device: int | None = Field(
        None,
        ge=0,
        le=1023,
        description="Device guard to use; PyTorch "
        "releases cached blocks on every device of the process.",
    )
    pid: int | None = Field(None, ge=1, description="Under gpumem-exporter run: only this process.")
    rank: int | None = Field(None, ge=0, description="Under gpumem-exporter run: only this rank.")


class _Selected(Protocol):
    pid: int | None
    rank: int | None


class HistoryRequest(_Body):
    enabled: bool
    max_entries: int = Field(100_000, ge=1, le=1_000_000)
    stacks: Literal["python", "all"] = "python"
    context: Literal["all", "alloc", "state"] = "all"
    snapshot_before_stop: bool = Field(
        True, description="Stopping clears the history buffer: dump it first."
    )


class ResetPeakRequest(_Body):
    device: int | None = Field(None, ge=0, le=1023)


BodyT = TypeVar("BodyT", bound=_Body)


class AdminError(Exception):
    def __init__(
        self, status: int, detail: str, outcome: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status, self.detail, self.outcome, self.headers = status, detail, outcome, headers


class Admin:
    """State of the admin API: who may call it, cooldowns, the one capture in flight."""

    def __init__(
        self,
        config: Config,
        actions: Actions,
        sampler: Sampler,
        detectors: Detectors | None = None,
        mode: str = "embedded",
        clock: Callable[[], float] = time.monotonic,
        aggregator: Aggregator | None = None,
    ) -> None:
        self.config = config
        # Under `gpumem-exporter run`: actions fan out to the server's processes.
        self.aggregator = aggregator
        self.actions = actions
        self.sampler = sampler
        self.detectors = detectors
        self.mode = mode
        self.requests: Counter[tuple[str, str]] = Counter()  # (action, outcome)
        self._clock = clock
        self._last_empty_cache: float | None = None
        self._capture_lock = threading.Lock()
        self._capturing: SnapshotInfo | None = None
        self._render_lock = threading.Lock()
        self._pages: dict[str, str] = {}  # snapshot id -> rendered page, oldest first

    # -- plumbing ------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        try:
            expected = self.config.resolved_admin_token()
        except ConfigError as exc:
            log.error("admin token unavailable: %s", exc)
            raise AdminError(403, DISABLED, "disabled") from None
        if not expected:
            raise AdminError(403, DISABLED, "disabled")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # Constant-time comparison; the token itself is never logged or echoed.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), expected.encode()
        ):
            raise AdminError(
                401,
                "missing or invalid bearer token",
                "unauthorized",
                {"WWW-Authenticate": "Bearer"},
            )

    async def body(self, request: Request, model: type[BodyT]) -> BodyT:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
            raise AdminError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise AdminError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid")
            chunks.append(chunk)
        raw = b"".join(chunks).strip() or b"{}"
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            raise AdminError(422, f"invalid request: {problems}", "invalid") from None

    def respond(self, body: dict[str, Any], status: int = 200) -> JSONResponse:
        body = {**body, "replay": self.actions.replay}
        if self.actions.replay:
            body["note"] = REPLAY_NOTE
        return JSONResponse(body, status_code=status)

    # -- actions -------------------------------------------------------------------------

    def empty_cache(self, params: EmptyCacheRequest) -> dict[str, Any]:
        now = self._clock()
        cooldown = self.config.empty_cache_cooldown_s
        if self._last_empty_cache is not None and now - self._last_empty_cache < cooldown:
            retry = math.ceil(cooldown - (now - self._last_empty_cache))
            raise AdminError(
                429,
                f"empty_cache ran less than {cooldown:g} s ago; it waits for "
                "all queued GPU work and blocks allocations meanwhile",
                "cooldown",
                {"Retry-After": str(retry)},
            )
        self._last_empty_cache = now
        if self.aggregator is not None:
            return self._fan_out("empty_cache", params, {"device": params.device}, 60.0)
        self._check_selector(params)
        result = self.actions.empty_cache(params.device)
        return {
            "devices": result.devices,
            "reserved_before_bytes": {str(k): v for k, v in result.reserved_before_bytes.items()},
            "reserved_after_bytes": {str(k): v for k, v in result.reserved_after_bytes.items()},
            "released_bytes": result.released_bytes,
            "duration_s": round(result.duration_s, 6),
            "scope": "every device of the process",
        }

    def _check_selector(self, params: _Selected) -> None:
        """In a single process, a pid or rank that is not this one's names nothing."""
        if params.pid is not None and params.pid != os.getpid():
            raise AdminError(
                404, f"no process {params.pid} here (this is {os.getpid()})", "not_found"
            )
        if params.rank is not None and str(params.rank) != os.environ.get("RANK", "0"):
            raise AdminError(404, f"no rank {params.rank} here", "not_found")

    def _fan_out(
        self, action: str, selector: _Selected, params: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        assert self.aggregator is not None
        results = self.aggregator.command(
            action, params, pid=selector.pid, rank=selector.rank, timeout_s=timeout_s
        )
        if not results:
            raise AdminError(
                409,
                "no process of this server has initialized CUDA yet"
                + (" (or none matches pid/rank)" if selector.pid or selector.rank else ""),
                "unavailable",
            )
        return {"processes": results, "ok": all(r["ok"] for r in results)}

    def fan_out_snapshot(self, params: SnapshotRequest) -> dict[str, Any]:
        body = params.model_dump(exclude={"pid", "rank"})
        return self._fan_out("snapshot", params, body, (params.record_s or 0) + 60.0)

    def start_capture(self, params: SnapshotRequest) -> tuple[SnapshotInfo, bool]:
        """Immediate snapshot (done=True) or the start of a windowed one (done=False)."""
        self._check_selector(params)
        with self._capture_lock:
            if self._capturing is not None:
                raise AdminError(
                    409,
                    f"capture {self._capturing.id} is still recording; one capture at a time",
                    "conflict",
                )
            if params.record_s is None:
                return self.actions.snapshot("api"), True
            self.actions.capture()  # fail now (409/501) rather than after the window
            info = self.actions.store.reserve("record", meta={"record_s": params.record_s})
            self._capturing = info
        threading.Thread(
            target=self._record_window, args=(info, params), name="gpumem-record", daemon=True
        ).start()
        return info, False

    def _record_window(self, info: SnapshotInfo, params: SnapshotRequest) -> None:
        try:
            self.actions.record_window(
                info,
                params.record_s or 0,
                max_entries=params.max_entries,
                stacks=params.stacks,
                context=params.context,
            )
        except Exception as exc:
            log.error("windowed snapshot %s failed: %s", info.id, exc)
        finally:
            with self._capture_lock:
                self._capturing = None

    def history(self, params: HistoryRequest) -> dict[str, Any]:
        with self._capture_lock:
            if self._capturing is not None:
                raise AdminError(
                    409, f"capture {self._capturing.id} is recording history", "conflict"
                )
            dumped = None
            if params.enabled:
                state = self.actions.start_history(
                    max_entries=params.max_entries, stacks=params.stacks, context=params.context
                )
            else:
                if params.snapshot_before_stop and self.actions.history.enabled:
                    dumped = self.actions.snapshot("history").public()
                state = self.actions.stop_history()
        return {
            "enabled": state.enabled,
            "max_entries": state.max_entries,
            "stacks": state.stacks,
            "context": state.context,
            "since": state.since,
            "snapshot": dumped,
        }

    def render(self, info: SnapshotInfo) -> str:
        """The viewer page, cached per snapshot: rendering holds the GIL (0.3 s for the demo,
        seconds for huge snapshots), which an embedded exporter must not repeat per view."""
        from exporter.viewer import SnapshotError, load_snapshot, render_html

        with self._render_lock:
            if info.id in self._pages:
                return self._pages[info.id]
        meta = {
            "id": info.id,
            "trigger": info.trigger,
            "mode": self.mode,
            "replay": self.actions.replay,
            **info.meta,
        }
        try:
            page = render_html(
                load_snapshot(self.actions.store.path(info)),
                title=f"GPU memory snapshot {info.id}",
                meta=meta,
            )
        except SnapshotError as exc:
            raise AdminError(
                409, f"snapshot {info.id} cannot be rendered: {exc}", "conflict"
            ) from None
        with self._render_lock:
            self._pages[info.id] = page
            while len(self._pages) > 4:
                self._pages.pop(next(iter(self._pages)))
        return page

    def stats(self) -> dict[str, Any]:
        sample = self.sampler.latest
        firing = [
            {"alert": a, "device": d}
            for a, d, f in (self.detectors.firing() if self.detectors else [])
            if f
        ]
        return {
            "mode": self.mode,
            "sample": sample.to_dict() if sample else None,
            "alerts_firing": firing,
            "history": {
                "enabled": self.actions.history.enabled,
                "max_entries": self.actions.history.max_entries,
            },
        }


def _schema(model: type[BaseModel], required: bool = False) -> dict[str, Any]:
    """Declare a body in OpenAPI (the routes read it themselves, to bound its size)."""
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def add_admin_routes(app: FastAPI, admin: Admin) -> None:
    Handler = Callable[..., Awaitable[Response]]

    def guarded(action: str) -> Callable[[Handler], Handler]:
        """Authorize, map errors to status codes, count every outcome."""

        def wrap(handler: Handler) -> Handler:
            async def route(request: Request, **kwargs: Any) -> Response:
                try:
                    admin.authorize(request)
                    response = await handler(request, **kwargs)
                except AdminError as exc:
                    admin.requests[(action, exc.outcome)] += 1
                    return JSONResponse(
                        {"detail": exc.detail}, status_code=exc.status, headers=exc.headers
                    )
                except ActionUnavailable as exc:
                    outcome = "unsupported" if exc.unsupported else "unavailable"
                    admin.requests[(action, outcome)] += 1
                    return JSONResponse(
                        {"detail": str(exc)}, status_code=501 if exc.unsupported else 409
                    )
                except Exception as exc:
                    admin.requests[(action, "error")] += 1
                    log.exception("admin %s failed", action)
                    return JSONResponse(
                        {"detail": f"{action} failed: {type(exc).__name__}"}, status_code=500
                    )
                admin.requests[(action, "ok")] += 1
                return response

            route.__name__ = handler.__name__
            route.__doc__ = handler.__doc__
            route.__signature__ = inspect.signature(handler)  # type: ignore[attr-defined]
            return route

        return wrap

    tags: list[str | Enum] = ["admin"]

    @app.post(
        "/snapshot",
        tags=tags,
        status_code=201,
        openapi_extra=_schema(SnapshotRequest),
        responses={202: {"description": "recording; poll GET /snapshots/{id}"}},
    )
    @guarded("snapshot")
    async def snapshot(request: Request) -> Response:
        """Capture an allocator snapshot now, or record history for `record_s` and then dump
        it (202 + id). Holds the GIL while it builds stack frames: ~2 ms without history,
        seconds with 50k live blocks with stacks (docs/performance.md)."""
        params = await admin.body(request, SnapshotRequest)
        if admin.aggregator is not None:  # one snapshot per process; waits for windows
            return admin.respond(await run_in_threadpool(admin.fan_out_snapshot, params), 201)
        info, done = await run_in_threadpool(admin.start_capture, params)
        return admin.respond(info.public(), 201 if done else 202)

    @app.get("/snapshots", tags=tags)
    @guarded("list")
    async def list_snapshots(request: Request) -> Response:
        """Snapshots kept by this process, newest first."""
        return admin.respond({"snapshots": [i.public() for i in admin.actions.store.list()]})

    def _ready(snapshot_id: str) -> SnapshotInfo:
        info = admin.actions.store.get(snapshot_id)
        if info is None:
            raise AdminError(404, f"no snapshot {snapshot_id!r}", "not_found")
        if info.status != "ready":
            detail = info.meta.get("error", "") if info.status == "failed" else ""
            raise AdminError(
                409,
                f"snapshot {info.id} is {info.status}" + (f": {detail}" if detail else ""),
                "conflict",
            )
        return info

    @app.get(
        "/snapshots/{snapshot_id}",
        tags=tags,
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    @guarded("download")
    async def download_snapshot(request: Request, snapshot_id: str) -> Response:
        """The snapshot pickle (open it with torch.cuda._memory_viz or pytorch.org/memory_viz,
        or `gpumem-exporter view`)."""
        info = _ready(snapshot_id)
        return FileResponse(
            admin.actions.store.path(info),
            filename=info.filename,
            media_type="application/octet-stream",
        )

    @app.get("/snapshots/{snapshot_id}/view", tags=tags, response_class=HTMLResponse)
    @guarded("view")
    async def view_snapshot(request: Request, snapshot_id: str) -> Response:
        """A self-contained HTML page (no external resource) of the snapshot."""
        info = _ready(snapshot_id)
        html = await run_in_threadpool(admin.render, info)
        return HTMLResponse(
            html, headers={"Content-Security-Policy": VIEW_CSP, "X-Content-Type-Options": "nosniff"}
        )

    @app.delete("/snapshots/{snapshot_id}", tags=tags, status_code=204)
    @guarded("delete")
    async def delete_snapshot(request: Request, snapshot_id: str) -> Response:
        """Remove a snapshot."""
        info = admin.actions.store.get(snapshot_id)
        if info is None:
            raise AdminError(404, f"no snapshot {snapshot_id!r}", "not_found")
        if info.status == "recording":
            raise AdminError(409, f"snapshot {info.id} is still recording", "conflict")
        if info.status == "failed":
            admin.actions.store.discard(info)
        else:
            admin.actions.store.delete(info.id)
        return Response(status_code=204)

    @app.post("/empty-cache", tags=tags, openapi_extra=_schema(EmptyCacheRequest))
    @guarded("empty_cache")
    async def empty_cache(request: Request) -> Response:
        """Return fully free cached segments to the driver. It waits for all GPU work queued
        on the process's streams and blocks the server's allocations meanwhile (measured at
        3 s with 3 s of work queued): rate-limited, 429 with Retry-After within the cooldown."""
        params = await admin.body(request, EmptyCacheRequest)
        return admin.respond(await run_in_threadpool(admin.empty_cache, params))

    @app.get("/history", tags=tags)
    @guarded("history")
    async def get_history(request: Request) -> Response:
        """Whether allocation history is being recorded, and with what limits."""
        state = admin.actions.history
        return admin.respond(
            {
                "enabled": state.enabled,
                "max_entries": state.max_entries,
                "stacks": state.stacks,
                "context": state.context,
                "since": state.since,
            }
        )

    @app.post("/history", tags=tags, openapi_extra=_schema(HistoryRequest, required=True))
    @guarded("history")
    async def set_history(request: Request) -> Response:
        """Start or stop recording allocation history (always bounded by max_entries).
        Stopping clears PyTorch's buffer, so by default a snapshot is taken first."""
        params = await admin.body(request, HistoryRequest)
        return admin.respond(await run_in_threadpool(admin.history, params))

    @app.post("/reset-peak", tags=tags, openapi_extra=_schema(ResetPeakRequest))
    @guarded("reset_peak")
    async def reset_peak(request: Request) -> Response:
        """Set peak = current. Global to the process: it also resets what the application's
        own torch.cuda.max_memory_allocated() reports."""
        params = await admin.body(request, ResetPeakRequest)
        devices = await run_in_threadpool(admin.actions.reset_peak, params.device)
        return admin.respond({"devices": devices, "scope": "process"})

    @app.get("/stats", tags=tags)
    @guarded("stats")
    async def stats(request: Request) -> Response:
        """The latest sample as JSON, with firing in-process alerts."""
        return admin.respond(admin.stats())
