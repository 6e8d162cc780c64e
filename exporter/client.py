"""A small client for a running exporter's admin API (used by the CLI)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from exporter import atomic


class ClientError(RuntimeError):
    """The exporter refused or could not be reached; str() is one line."""


class AdminClient:
    def __init__(self, base_url: str, token: str, *, timeout_s: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, AttributeError):
                detail = json.loads(detail).get("detail", detail)
            raise ClientError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ClientError(
                f"cannot reach {self.base_url}: {getattr(exc, 'reason', exc)}"
            ) from None

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        _, payload = self._request(method, path, body)
        result: dict[str, Any] = json.loads(payload)
        return result

    def snapshot(self, *, record_s: float | None = None, stacks: str = "python") -> dict[str, Any]:
        """Take a snapshot; with record_s, wait until the windowed capture is ready."""
        body: dict[str, Any] = {"stacks": stacks}
        if record_s is not None:
            body["record_s"] = record_s
        info = self._json("POST", "/snapshot", body)
        deadline = time.monotonic() + (record_s or 0) + self.timeout_s
        while info.get("status") == "recording":
            if time.monotonic() > deadline:
                raise ClientError(f"snapshot {info['id']} still recording after the timeout")
            time.sleep(min(1.0, max(record_s or 0, 0.1)))
            listing = self._json("GET", "/snapshots")["snapshots"]
            current = next((s for s in listing if s["id"] == info["id"]), None)
            if current is None:
                raise ClientError(f"snapshot {info['id']} disappeared while recording")
            if current["status"] == "failed":
                raise ClientError(
                    f"snapshot {info['id']} failed: {current['meta'].get('error', 'unknown error')}"
                )
            info = {**current, "replay": info.get("replay")}
        return info

    def download(self, snapshot_id: str, output: Path) -> int:
        """Write the snapshot to `output` atomically; returns its size in bytes."""
        _, payload = self._request("GET", f"/snapshots/{snapshot_id}")
        atomic.write_bytes(output, payload)
        return len(payload)

    def empty_cache(self, device: int | None = None) -> dict[str, Any]:
        return self._json("POST", "/empty-cache", {"device": device} if device is not None else {})
