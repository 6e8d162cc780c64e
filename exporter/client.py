"""A small client for a running exporter's admin API (used by the CLI).

Every action answers a list of per-process results in every mode (exporter.http.admin), so the
same calls work against an embedded exporter, the demo and `gpumem-exporter run`.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from exporter import atomic
from exporter.actions.base import Target
from exporter.actions.snapshots import ID_PATTERN, STATUSES
from exporter.actions.spec import SNAPSHOT, STOP_CAPTURE, Action, ParamError
from exporter.no_redirects import opener
from exporter.refusals import basic_auth_hint

EVERY_PROCESS = Target()
CHUNK_BYTES = 1 << 20  # a download's piece
# The largest answer other than a snapshot download: /stats of 256 processes is under 1 MiB. An
# answer that goes on past this is no exporter's (round 4: an endless chunked body took the
# CLI to GBs in seconds).
MAX_ANSWER_BYTES = 32 << 20
MAX_ERROR_BYTES = 64 << 10  # the body of an error answer: its detail, one line of it shown


class ClientError(RuntimeError):
    """The exporter refused or could not be reached; str() is one line."""


def _checked(answer: dict[str, Any], what: str) -> dict[str, Any]:
    """An action's answer as exporter.http.admin sends it: {"processes": [{"process": {...},
    "ok": bool, "result": {...} or null, "error": ...}], ...}. The CLI acts on these answers
    (it names files after them), so anything else is a one-line ClientError, not a guess."""

    def bad(why: str) -> ClientError:
        return ClientError(f"{what}: unexpected answer from the exporter: {why}")

    entries = answer.get("processes")
    if not isinstance(entries, list):
        raise bad("no list of processes")
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("ok"), bool):
            raise bad("a process entry without ok")
        process = entry.get("process")
        if not isinstance(process, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in process.items()
        ):
            raise bad("a process entry without its labels")
        pid = process.get("pid") or "0"
        if not pid.isdigit():
            raise bad(f"pid {pid[:32]!r}")
        if entry["ok"] and not isinstance(entry.get("result"), (dict, type(None))):
            raise bad("a result that is not an object")
    return answer


def _snapshot_info(info: Any, what: str) -> dict[str, Any]:
    """A snapshot entry whose id and file name are safe to use: the id goes into a URL, the
    file name into the user's folder, so only a plain name is taken (never a path)."""
    if not isinstance(info, dict):
        raise ClientError(f"{what}: unexpected answer from the exporter: a snapshot entry")
    snapshot_id, name = info.get("id"), info.get("filename")
    if not isinstance(snapshot_id, str) or not ID_PATTERN.fullmatch(snapshot_id):
        raise ClientError(f"{what}: the exporter answered an invalid snapshot id")
    if (
        not isinstance(name, str)
        or name != Path(name).name
        or name in ("", ".", "..")
        or len(name) > 255
        or any(c in name for c in "\\\x00")
    ):
        raise ClientError(
            f"{what}: the exporter answered a file name that is not a plain name: {name!r:.80}"
        )
    if info.get("status") not in STATUSES:
        raise ClientError(f"{what}: unexpected answer from the exporter: snapshot status")
    return info


def _selector(target: Target, **fields: Any) -> dict[str, Any]:
    """A request body (or query): the target's pid/rank and the fields that are set."""
    return {
        k: v for k, v in {"pid": target.pid, "rank": target.rank, **fields}.items() if v is not None
    }


def tls_context(
    ca_file: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> ssl.SSLContext:
    """How the client checks an https exporter: `ca_file` (else the system's CAs), and the
    client certificate it shows where the exporter asks for one."""
    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        if cert is not None:
            context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise ClientError(f"cannot read {exc.filename or 'a TLS file'}: no such file") from None
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise ClientError(f"cannot use the TLS files given: {reason}") from None
    return context


def basic_authorization(user: str, password: str) -> str:
    """The Authorization value of basic auth (the web config's basic_auth_users)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def kubeconfig_token(env: Mapping[str, str]) -> str:
    """The bearer token of the current context's user in the kubeconfig (KUBECONFIG, else
    ~/.kube/config): its `token`, or the file its `tokenFile` names. Exec and auth-provider
    plugins are not run: `kubectl create token` gives a token for those users."""
    import yaml

    name = (env.get("KUBECONFIG") or "").split(os.pathsep)[0] or str(
        Path(env.get("HOME", "~")).expanduser() / ".kube" / "config"
    )
    try:
        config = yaml.safe_load(Path(name).read_text()) or {}
    except OSError as exc:
        raise ClientError(f"cannot read kubeconfig {name}: {exc.strerror}") from None
    except yaml.YAMLError:
        raise ClientError(f"kubeconfig {name} is not YAML") from None
    try:
        context_name = config["current-context"]
        context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
    except (KeyError, TypeError, StopIteration):
        raise ClientError(f"kubeconfig {name}: no user for its current context") from None
    if user.get("token"):
        return str(user["token"]).strip()
    if user.get("tokenFile"):
        try:
            return Path(user["tokenFile"]).read_text().strip()
        except OSError as exc:
            raise ClientError(f"kubeconfig tokenFile {user['tokenFile']}: {exc.strerror}") from None
    raise ClientError(
        f"kubeconfig {name}: the current user has no token (exec and auth-provider users are "
        "not run): use --token-file with `kubectl create token ...`"
    )


class AdminClient:
    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout_s: float = 60.0,
        context: ssl.SSLContext | None = None,
        basic: str | None = None,
    ) -> None:
        """`token`: the admin bearer token; None sends none (the demo, loopback admin).
        `context`: for https; `basic`: an Authorization value for basic auth, sent where no
        token is (an exporter whose admin API has no credentials of its own asks for it)."""
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self._context = context
        self._basic = basic
        self._opener = opener(context)

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, bytes]:
        """One exchange whose answer is at most MAX_ANSWER_BYTES and whole within timeout_s
        (a socket timeout bounds each read, not a trickle of one byte a second)."""
        what = f"{method} {path}"
        return _within(
            self.timeout_s,
            what,
            lambda: self._exchange(method, path, body, lambda r: _bounded_read(r, what)),
        )

    def _exchange(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        consume: Callable[[Any], Any],
    ) -> tuple[int, Any]:
        """(status, consume(response)); ClientError in one line for any failure, including
        one while the answer is read."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        if self._token is not None:
            request.add_header("Authorization", f"Bearer {self._token}")
        elif self._basic is not None:
            request.add_header("Authorization", self._basic)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return response.status, consume(response)
        except urllib.error.HTTPError as exc:
            raw = exc.read(MAX_ERROR_BYTES) if exc.fp is not None else b""
            detail = raw.decode(errors="replace")
            with contextlib.suppress(ValueError, AttributeError):
                detail = json.loads(detail).get("detail", detail)
            if 300 <= exc.code < 400:  # _NoRedirect: where it pointed, not its body
                detail = str(exc.msg)
            basic = basic_auth_hint(
                exc.headers.get("WWW-Authenticate") if exc.headers else None,
                self._basic is not None,
            )
            if exc.code == 401 and basic is not None:
                detail = basic  # the web config's basic auth, before any route but the probes
            elif exc.code == 401 and self._token is None:
                detail = (
                    "the exporter asks for an admin token: pass --token-file, or set "
                    "GPUMEM_ADMIN_TOKEN_FILE or GPUMEM_ADMIN_TOKEN"
                )
            retry_after = exc.headers.get("Retry-After") if exc.headers else None
            if retry_after:
                detail = f"{detail} (retry in {retry_after} s)"
            raise ClientError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise ClientError(
                f"cannot reach {self.base_url}: {getattr(exc, 'reason', None) or exc!r}"
            ) from None

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        _, payload = self._request(method, path, body)
        try:
            result = json.loads(payload)
        except ValueError:
            raise ClientError(f"{method} {path}: the answer is not JSON") from None
        except RecursionError:  # json's parser recurses per level: 100,000 "[" end it
            raise ClientError(f"{method} {path}: the answer nests too deeply") from None
        if not isinstance(result, dict):
            raise ClientError(f"{method} {path}: the answer is not a JSON object")
        return result

    def _action(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """An admin action's answer, its shape checked (_checked)."""
        return _checked(self._json(method, path, body), f"{method} {path}")

    @staticmethod
    def _query(path: str, target: Target, **fields: Any) -> str:
        query = urllib.parse.urlencode(_selector(target, **fields))
        return path + (f"?{query}" if query else "")

    def act(self, action: Action, target: Target = EVERY_PROCESS, **params: Any) -> dict[str, Any]:
        """Run a declared action (exporter.actions.spec) in each selected process: the given
        parameters are checked here as the exporter checks them, and only those are sent
        (the exporter fills in the defaults)."""
        given = {k: v for k, v in params.items() if v is not None}
        try:
            action.check(given)
        except ParamError as exc:
            raise ClientError(str(exc)) from None
        if action.method == "GET":
            return self._action("GET", self._query(action.path, target, **given))
        return self._action(action.method, action.path, _selector(target, **given))

    def snapshot(
        self,
        target: Target = EVERY_PROCESS,
        *,
        record_s: float | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """Take a snapshot in each selected process; with record_s, wait until every windowed
        capture is ready. Returns the response, each process's result its final entry."""
        answer = self.act(SNAPSHOT, target, record_s=record_s, **params)
        deadline = time.monotonic() + (record_s or 0) + self.timeout_s
        for entry in answer["processes"]:
            if not entry["ok"]:
                continue
            info = _snapshot_info(entry.get("result"), "POST /snapshot")
            while info["status"] == "recording":
                if time.monotonic() > deadline:
                    raise ClientError(f"snapshot {info['id']} still recording after the timeout")
                time.sleep(min(1.0, max(record_s or 0, 0.1)))
                path = f"/snapshots/{info['id']}/info"
                info = _snapshot_info(self._json("GET", path), f"GET {path}")
                if info["status"] == "failed":
                    entry["ok"] = False
                    entry["error"] = f"snapshot {info['id']} failed: " + str(
                        info.get("meta", {}).get("error", "unknown error")
                    )
                entry["result"] = info
        answer["ok"] = all(e["ok"] for e in answer["processes"])
        return answer

    def stop_capture(self, target: Target = EVERY_PROCESS) -> dict[str, Any]:
        """End the windowed capture of each selected process now; each process's result is
        the entry it wrote (None where none was recording)."""
        answer = self.act(STOP_CAPTURE, target)
        for entry in answer["processes"]:
            if entry["ok"]:
                stopped = (entry.get("result") or {}).get("stopped")
                entry["result"] = (
                    None if stopped is None else _snapshot_info(stopped, "POST /snapshot/stop")
                )
        return answer

    def download(self, snapshot_id: str, output: Path) -> int:
        """Write the snapshot to `output` atomically, streamed (a snapshot can be GBs: never
        held whole in memory); returns its size in bytes. A download cut off leaves no file."""

        def chunks(response: Any) -> Iterable[bytes]:
            expected, size = response.headers.get("Content-Length"), 0
            for chunk in iter(lambda: response.read(CHUNK_BYTES), b""):
                size += len(chunk)
                yield chunk
            # http.client ends a read short without a word when the connection closes early.
            if expected is not None and expected.isdigit() and size != int(expected):
                raise ClientError(
                    f"GET /snapshots/{snapshot_id}: the download ended after {size} of "
                    f"{expected} bytes: nothing written"
                )

        def save(response: Any) -> int:
            return atomic.write_chunks(output, chunks(response))

        _, size = self._exchange("GET", f"/snapshots/{snapshot_id}", None, save)
        return int(size)

    def list_snapshots(self, target: Target = EVERY_PROCESS) -> list[dict[str, Any]]:
        """The snapshots the exporter keeps (of the selected processes), newest first."""
        answer = self._json("GET", self._query("/snapshots", target))
        listed = answer.get("snapshots")
        if not isinstance(listed, list):
            raise ClientError("GET /snapshots: the answer has no list of snapshots")
        return [_snapshot_info(entry, "GET /snapshots") for entry in listed]

    def stats(self, target: Target = EVERY_PROCESS) -> dict[str, Any]:
        return self._json("GET", self._query("/stats", target))


def _bounded_read(response: Any, what: str) -> bytes:
    """The answer's body, read a socket read at a time, refused past MAX_ANSWER_BYTES."""
    data = bytearray()
    while chunk := response.read1(1 << 16):
        data += chunk
        if len(data) > MAX_ANSWER_BYTES:
            raise ClientError(
                f"{what}: the answer goes on past {MAX_ANSWER_BYTES >> 20} MiB: not an exporter's"
            )
    return bytes(data)


def _within(timeout_s: float, what: str, call: Callable[[], Any]) -> Any:
    """call() on a thread of its own, given up after timeout_s: urllib has no deadline for a
    whole exchange, and a server may trickle its head or body. The CLI exits after the error;
    the abandoned thread is a daemon and holds nothing the process needs."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the caller's thread as it is
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="gpumem-cli-request", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ClientError(f"{what}: no whole answer within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
