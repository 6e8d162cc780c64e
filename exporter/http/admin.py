"""The token-protected admin API: snapshots (and stopping a windowed one), empty_cache, history,
peak reset, stats.

Every action route calls the mode's actions implementation (exporter.actions) and answers one
shape in every mode: `{"processes": [{"process": {...}, "ok": ..., "result" | "error": ...}],
"ok": ..., "replay": ...}`, one entry per process the action ran in (one outside
`gpumem-exporter run`). `pid` and `rank` choose one process, in every mode.

Status codes: 401 without a valid bearer token, 403 when no token is configured (admin actions
are off; the demo, whose actions change nothing, answers without one), 413 for bodies over
16 KiB, 422 for invalid input, 404 when pid/rank names no process; when every selected process
failed the same way, 409 (not possible now: CUDA not initialized, a capture in progress), 429
with Retry-After (empty_cache within its cooldown), 501 (the backend cannot: cudaMallocAsync has
no snapshots), 507 (the snapshot folder is full, read-only or not ours: the reason is in the
answer), 502/504 (a process's agent is gone or did not answer). A partial failure answers 200
with `"ok": false`. Slow work runs in worker threads, off the event loop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute

from exporter.actions.base import OUTCOME_STATUS, Actions, ProcessResult, Target
from exporter.actions.snapshots import SnapshotInfo
from exporter.actions.spec import ACTIONS, Action
from exporter.actions.stats import latest_stats
from exporter.config import Config
from exporter.detectors import Detectors
from exporter.http.access import AdminCallers, AdminError
from exporter.identity import describe_process
from exporter.kubernetes.identities import KubernetesIdentities
from exporter.oom_pending import PendingOoms
from exporter.ratelimit import RateLimitedLog
from exporter.request_counts import RequestCounts
from exporter.sampler import Sampler
from exporter.traits import Traits
from exporter.viewer import PAGE_CSP, SnapshotError
from exporter.viewer.pages import RenderedPages

log = logging.getLogger("exporter.admin")
# Who did what: one line per admin action (docs/reliability.md, the threat model).
audit = logging.getLogger("exporter.audit")

MAX_BODY_BYTES = 16 * 1024
REPLAY_NOTE = "replay: answered from data recorded on a real GPU; nothing was changed"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pid: int | None = Field(None, ge=1, description="Only this process (host PID).")
    rank: int | None = Field(None, ge=0, description="Only the process with this RANK.")

    @property
    def target(self) -> Target:
        return Target(self.pid, self.rank)


def request_model(action: Action) -> type[_Body]:
    """The body an action's route takes: pid/rank and the action's declared parameters,
    with the same bounds (exporter.actions.spec), for validation and the OpenAPI schema."""
    fields: dict[str, Any] = {}
    for param in action.params:
        kind: Any = Literal[param.choices] if param.choices else param.kind
        if param.default is None and not param.required:
            kind = kind | None
        default = ... if param.required else param.default
        # Strict: "0" is not a device and 1 is not true (pydantic's lax mode would take
        # both), as the declaration, and each agent checking it, would refuse them.
        field: Any = Field(
            default,
            description=param.help,
            ge=param.minimum,
            gt=param.above,
            le=param.maximum,
            strict=None if param.choices else True,  # a choice is exact already
        )
        fields[param.name] = (kind, field)
    name = "".join(part.title() for part in action.name.split("_")) + "Request"
    model: type[_Body] = create_model(name, __base__=_Body, **fields)
    return model


REQUEST_MODELS = {action.name: request_model(action) for action in ACTIONS}


class Selector(_Body):
    """pid/rank as query parameters, for the GET routes."""


BodyT = TypeVar("BodyT", bound=_Body)


class Admin:
    """State of the admin API: who may call it, what it counted, rendered pages."""

    def __init__(
        self,
        config: Config,
        actions: Actions,
        sampler: Sampler,
        detectors: Detectors | None = None,
        traits: Traits | None = None,
        identities: KubernetesIdentities | None = None,
        requests: RequestCounts | None = None,
        pending_ooms: PendingOoms | None = None,
    ) -> None:
        self.config = config
        self.pending_ooms = pending_ooms if pending_ooms is not None else PendingOoms()
        self.actions = actions
        self.sampler = sampler
        self.detectors = detectors
        self.traits = traits or Traits("embedded")  # what its mode decides (exporter.traits)
        # Counted here, read by /metrics (exporter.request_counts).
        self.requests = requests if requests is not None else RequestCounts()
        # Who may call the admin routes: decided in the access module with every other rule.
        self.callers = AdminCallers(config, self.traits, identities)
        self._pages = RenderedPages()

    # -- plumbing ------------------------------------------------------------------------

    async def body(self, request: Request, model: type[BodyT]) -> BodyT:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
            raise AdminError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise AdminError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid")
                chunks.append(chunk)
        except ClientDisconnect:  # the client's doing, not the server's: nothing ran
            raise AdminError(
                400, "the client went away before sending the whole body", "disconnected"
            ) from None
        raw = b"".join(chunks).strip() or b"{}"
        return self._validate(model, raw)

    def query(self, request: Request) -> Target:
        """pid/rank from the query string (GET routes)."""
        params = dict(request.query_params)
        if set(params) - {"pid", "rank"}:
            unknown = ", ".join(sorted(set(params) - {"pid", "rank"}))
            raise AdminError(
                422, f"invalid request: unknown query parameter(s) {unknown}", "invalid"
            )
        if not params:
            return Target()
        try:
            return Selector.model_validate(params).target
        except ValidationError as exc:
            raise AdminError(422, f"invalid request: {_problems(exc)}", "invalid") from None

    @staticmethod
    def _validate(model: type[BodyT], raw: bytes) -> BodyT:
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise AdminError(422, f"invalid request: {_problems(exc)}", "invalid") from None

    def respond(self, body: dict[str, Any], status: int = 200) -> Answer:
        body = {**body, "replay": self.traits.recorded}
        if self.traits.recorded:
            body["note"] = REPLAY_NOTE
        return Answer(body, status_code=status)

    def answer(self, target: Target, results: list[ProcessResult], ok_status: int = 200) -> Answer:
        """The one response shape of every action, with a status that sums it up."""
        if not results:
            if target.selective:
                raise AdminError(404, f"no process matches {target.describe()}", "not_found")
            raise AdminError(
                409, "no process of this server has initialized CUDA yet", "unavailable"
            )
        ok = all(r.ok for r in results)
        body: dict[str, Any] = {"processes": [r.to_dict() for r in results], "ok": ok}
        headers = None
        if ok:
            status, outcome = ok_status, "ok"
        elif any(r.ok for r in results):
            status, outcome = 200, "partial"
        else:
            outcomes = {r.outcome for r in results}
            outcome = outcomes.pop() if len(outcomes) == 1 else "error"
            status = OUTCOME_STATUS.get(outcome, 500)
            retry = [r.retry_after_s for r in results if r.retry_after_s is not None]
            if retry:
                headers = {"Retry-After": str(math.ceil(max(retry)))}
        if not ok:
            body["detail"] = "; ".join(
                f"{describe_process(r.process)}: {r.error}" for r in results if not r.ok
            )
        response = self.respond(body, status)
        response.outcome = outcome
        if headers:
            response.headers.update(headers)
        return response

    # -- the snapshot store ----------------------------------------------------------------

    def entry(self, snapshot_id: str) -> SnapshotInfo:
        info = self.actions.store.get(snapshot_id)
        if info is None:
            raise AdminError(404, f"no snapshot {snapshot_id!r}", "not_found")
        return info

    def ready(self, snapshot_id: str) -> SnapshotInfo:
        """A snapshot that can be read: 409 while it records, or if it failed."""
        info = self.entry(snapshot_id)
        if info.status != "ready":
            detail = info.meta.get("error", "") if info.status == "failed" else ""
            raise AdminError(
                409,
                f"snapshot {info.id} is {info.status}" + (f": {detail}" if detail else ""),
                "conflict",
            )
        return info

    def delete(self, info: SnapshotInfo) -> None:
        if info.status == "recording":
            raise AdminError(409, f"snapshot {info.id} is still recording", "conflict")
        try:
            if info.status == "failed":
                self.actions.store.discard(info)
            else:
                self.actions.store.delete(info.id)
        except OSError as exc:  # a read-only or foreign folder: still listed, still there
            reason = exc.strerror or type(exc).__name__
            raise AdminError(
                507, f"cannot delete snapshot {info.id}: {reason}", "insufficient_storage"
            ) from None

    # -- pages -------------------------------------------------------------------------

    def render(self, info: SnapshotInfo) -> str:
        """The viewer page of a snapshot, rendered once (exporter.viewer.pages)."""
        meta = {
            "id": info.id,
            "trigger": info.trigger,
            "mode": self.traits.name,
            "replay": self.traits.recorded,
            **info.meta,
        }
        path, title = self.actions.store.path(info), f"GPU memory snapshot {info.id}"
        try:
            return self._pages.page(info.id, path, title=title, meta=meta)
        except SnapshotError as exc:  # not a snapshot, or over the viewer's limits
            raise AdminError(
                422, f"snapshot {info.id} cannot be rendered: {exc}", "invalid"
            ) from None


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())


class Answer(JSONResponse):
    """An action's response, which says how it ended (for the admin request counter)."""

    outcome = "ok"


def _schema(model: type[BaseModel], required: bool = False) -> dict[str, Any]:
    """Declare a body in OpenAPI (the routes read it themselves, to bound its size)."""
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


SELECTOR_QUERY = {
    "parameters": [
        {
            "name": "pid",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1},
        },
        {
            "name": "rank",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 0},
        },
    ]
}


def add_admin_routes(app: FastAPI, admin: Admin) -> list[BaseRoute]:
    """Every admin route: one per declared action, and the snapshot store's and /stats.
    Each is authorized first (a dependency: exporter.http.access.AdminCallers) and counted
    under its name (_route_class).
    Returned: the access check knows them by this declaration (exporter.http.access)."""
    router = APIRouter(
        tags=["admin"],
        route_class=_route_class(admin),
        dependencies=[Depends(admin.callers.authorize)],
    )
    for action in ACTIONS:
        _add_action_route(router, admin, action)
    _add_store_routes(router, admin)

    @router.get("/stats", name="stats", openapi_extra=SELECTOR_QUERY)
    async def stats(request: Request) -> Response:
        """The latest sample as JSON, with firing in-process alerts (pid/rank: one process)."""
        target = admin.query(request)
        return admin.respond(
            latest_stats(
                admin.sampler.latest,
                target,
                mode=admin.traits.name,
                detectors=admin.detectors,
                pending_ooms=admin.pending_ooms,
                config=admin.config,
            )
        )

    # The routes themselves, not include_router's lazily included router: the app lists
    # every route it serves (OpenAPI, tests, an embedding host).
    app.router.routes.extend(router.routes)
    return list(router.routes)


def _route_class(admin: Admin) -> type[APIRoute]:
    class AdminRoute(APIRoute):
        """Answers an AdminError with its status and any other failure with a 500 that
        names only its type, and counts every outcome under the route's name."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            label = self.name

            async def counted(request: Request) -> Response:
                try:
                    response = await handler(request)
                except AdminError as exc:
                    admin.requests.add(label, exc.outcome)
                    _audit(request, label, exc.outcome, exc.status)
                    return JSONResponse(
                        {"detail": exc.detail}, status_code=exc.status, headers=exc.headers
                    )
                except Exception as exc:
                    admin.requests.add(label, "error")
                    _audit(request, label, "error", 500)
                    log.exception("admin %s failed", label)
                    return JSONResponse(
                        {"detail": f"{label} failed: {type(exc).__name__}"}, status_code=500
                    )
                outcome = getattr(response, "outcome", "ok")
                admin.requests.add(label, outcome)
                _audit(request, label, outcome, response.status_code)
                return response

            return counted

    return AdminRoute


def _add_action_route(router: APIRouter, admin: Admin, action: Action) -> None:
    model = REQUEST_MODELS[action.name]

    async def endpoint(request: Request) -> Response:
        if action.method == "GET":
            target, params = admin.query(request), action.check({})
        else:
            # The model holds the declared bounds: its dump is the checked parameters.
            body = await admin.body(request, model)
            target, params = body.target, body.model_dump(exclude={"pid", "rank"})
        results = await run_in_threadpool(admin.actions.perform, action.name, target, params)
        if (conflict := action.conflict(results)) is not None:
            raise AdminError(409, conflict, "unavailable")
        return admin.answer(target, results, action.ok_status(results))

    endpoint.__name__ = action.name
    if action.method == "GET":
        extra = SELECTOR_QUERY
    else:
        extra = _schema(model, required=any(p.required for p in action.params))
    router.add_api_route(
        action.path,
        endpoint,
        methods=[action.method],
        name=action.label,
        description=action.help,
        status_code=action.ok_status([]),
        responses={status: {"description": text} for status, text in action.other_statuses},
        openapi_extra=extra,
    )


def _add_store_routes(router: APIRouter, admin: Admin) -> None:
    """The snapshots kept by this server: list, fetch, view and delete them."""
    store = admin.actions.store

    @router.get("/snapshots", name="list")
    async def list_snapshots(request: Request) -> Response:
        """Snapshots kept by this server (every process of it), newest first."""
        target = admin.query(request)
        listed = [
            i.public()
            for i in store.list()
            if not target.selective or target.matches(_snapshot_process(i))
        ]
        return admin.respond({"snapshots": listed})

    @router.get(
        "/snapshots/{snapshot_id}",
        name="download",
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    async def download_snapshot(snapshot_id: str) -> Response:
        """The snapshot pickle (open it with torch.cuda._memory_viz or pytorch.org/memory_viz,
        or `gpumem-exporter view`). 409 while it is still recording, or if it failed."""
        info = admin.ready(snapshot_id)
        return FileResponse(
            store.path(info), filename=info.filename, media_type="application/octet-stream"
        )

    @router.get("/snapshots/{snapshot_id}/info", name="list")
    async def snapshot_info(snapshot_id: str) -> Response:
        """One snapshot's entry: poll it while a windowed capture is `recording`."""
        return admin.respond(admin.entry(snapshot_id).public())

    @router.get("/snapshots/{snapshot_id}/view", name="view", response_class=HTMLResponse)
    async def view_snapshot(snapshot_id: str) -> Response:
        """A self-contained HTML page (no external resource) of the snapshot."""
        html = await run_in_threadpool(admin.render, admin.ready(snapshot_id))
        return HTMLResponse(
            html, headers={"Content-Security-Policy": PAGE_CSP, "X-Content-Type-Options": "nosniff"}
        )

    @router.delete("/snapshots/{snapshot_id}", name="delete", status_code=204)
    async def delete_snapshot(snapshot_id: str) -> Response:
        """Remove a snapshot."""
        admin.delete(admin.entry(snapshot_id))
        return Response(status_code=204)


_refused_log = RateLimitedLog(audit)


def _audit(request: Request, label: str, outcome: str, status: int) -> None:
    """One line per admin action (what changes state) with who asked and from where; refusals
    too, at most once a minute per kind (a scanner must not flood the log). Never a credential.
    Not a read refused because admin actions are off: that is the live page asking what it may
    show, whenever it is open, and the server's log is the host's."""
    user = getattr(request.state, "admin_user", None) or "-"
    client = request.client.host if request.client else "-"
    line = f"admin {request.method} {label} by {user} from {client}: {outcome} ({status})"
    if outcome == "disabled" and request.method in ("GET", "HEAD"):
        return
    if status in (401, 403, 503):
        _refused_log.warning(outcome, line)
    elif request.method not in ("GET", "HEAD"):
        audit.info(line)


def _snapshot_process(info: SnapshotInfo) -> dict[str, str]:
    process = info.meta.get("process")
    return {str(k): str(v) for k, v in process.items()} if isinstance(process, dict) else {}
