"""The agent protocol of `gpumem-exporter run`: newline-delimited JSON over a Unix socket,
and the probe's binary records between the lines.

    agent -> aggregator   {"type": "hello", "version": 1, "process": {pid, rank, local_rank, role}}
                          {"type": "sample", "allocators": [AllocatorReading...], "actions": {...}}
                          a probe record as it is (exporter.probe.record: "GMPR", its version
                            and its size first): one device's numbers of one tick, updating
                            that device's latest sample
                          {"type": "reply", "id": N, "result": ProcessResult}
    aggregator -> agent   {"type": "command", "id": N, "action": NAME, "params": {...}}
                          {"type": "refused", "reason": TEXT}: not served (its process slots
                            are all taken), then the connection is closed

The aggregator trusts nothing an agent sends: every message is size-bounded and validated
here, field by field, and a message that fails is rejected with a short reason (a label of
gpumem_exporter_agent_messages_rejected_total). Standard library only: agents import it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, asdict, fields
from typing import Any

from exporter.actions.base import OUTCOME_STATUS, ProcessResult
from exporter.actions.spec import BY_NAME
from exporter.catalog import PROCESS_LABELS
from exporter.components import (
    MAX_BYTES,
    MAX_COMPONENTS,
    MAX_NAME,
    OVERFLOW,
    PROBLEMS,
    ComponentError,
    check_name,
)
from exporter.oom_verdict import VERDICTS, OomVerdict
from exporter.pools import POOL_KINDS
from exporter.probe import record
from exporter.sample import (
    ALLOCATOR_COUNTERS,
    ALLOCATOR_GAUGES,
    LAYOUT_GAUGES,
    POOL_GAUGES,
    PRIVATE_POOL_GAUGES,
    ActionCounts,
    AllocatorReading,
    PinnedHostReading,
)

VERSION = 1
# A sample of 8 GPUs is about 8 KB; a reply carries a snapshot's entry, not the snapshot.
MAX_LINE_BYTES = 1 << 20
MAX_ALLOCATORS = 64
MAX_TEXT = 256
_POOLS = ("large", "small")
# The exporter keeps at most 16 private pools per device plus "other"; settings are scalars.
MAX_PRIVATE_POOLS = 17
MAX_SETTINGS = 16


class ProtocolError(ValueError):
    """A message that breaks the protocol; `reason` is a short, bounded label value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def encode(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


class StreamReader:
    """Splits a byte stream into its messages: JSON lines (never more than MAX_LINE_BYTES of
    one) and probe records, which start with record.MAGIC (a JSON line starts with "{") and
    say their size in their first bytes, in every version: a record of another version is
    taken whole and refused by record.unpack, the stream stays in step."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        buffer = self._buffer
        buffer += chunk
        start, size = 0, len(buffer)
        while start < size:
            if buffer[start] == _MAGIC_FIRST:
                end = self._record_end(buffer, start, size)
                if end is None:
                    break
                yield bytes(buffer[start:end])
                start = end
                continue
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            if end - start > self.max_line_bytes:
                raise ProtocolError("too_long", f"a line of {end - start} bytes")
            yield bytes(buffer[start:end])
            start = end + 1
        del buffer[:start]
        if len(buffer) > self.max_line_bytes:
            raise ProtocolError("too_long", f"over {self.max_line_bytes} bytes without a newline")

    @staticmethod
    def _record_end(buffer: bytearray, start: int, size: int) -> int | None:
        """Where the record at `start` ends; None until all of it is here."""
        if size - start < record.PREFIX.size:
            if not record.MAGIC.startswith(bytes(buffer[start : min(size, start + 4)])):
                raise ProtocolError("record", "neither a JSON line nor a probe record")
            return None
        magic, _, length = record.PREFIX.unpack_from(buffer, start)
        if magic != record.MAGIC or not record.PREFIX.size <= length <= record.MAX_BYTES:
            # No size to trust: nothing after this can be told apart again.
            raise ProtocolError("record", f"a record of {length} bytes cannot be taken")
        return start + length if size - start >= length else None


_MAGIC_FIRST = record.MAGIC[0]
# The first byte of version 1's record lines (base64 after it): a probe of that version.
OLD_RECORD_LINE = b"R"


def decode(line: bytes) -> dict[str, Any]:
    """One line to a message: a JSON object with a known `type`."""
    try:
        message = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise ProtocolError("json", "not JSON") from None
    if not isinstance(message, dict):
        raise ProtocolError("type", f"a JSON {type(message).__name__}, not an object")
    if message.get("type") not in ("hello", "sample", "reply", "command", "refused"):
        raise ProtocolError("type", f"unknown message type {str(message.get('type'))[:32]!r}")
    return message


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


# -- builders (agent side) ---------------------------------------------------------------


def hello(process: Mapping[str, str]) -> dict[str, Any]:
    return {"type": "hello", "version": VERSION, "process": dict(process)}


def sample(
    allocators: list[dict[str, Any]],
    counts: ActionCounts,
    pinned_host: PinnedHostReading | None = None,
) -> dict[str, Any]:
    # Fields as they are, not dataclasses.asdict: it deep-copies each one first, and this runs
    # in the serving process with every full sample (JSON copies them as it writes).
    pinned = None
    if pinned_host is not None:
        pinned = {k: v for k, v in vars(pinned_host).items() if k not in FROM_LAUNCHER}
    return {
        "type": "sample",
        "allocators": allocators,
        "pinned_host": pinned,
        "actions": vars(counts),
    }


def allocator_fields(reading: AllocatorReading) -> dict[str, Any]:
    """One reading as a sample message's allocator: its fields as they are (JSON copies them
    as it writes; dataclasses.asdict would deep-copy every dict first, ~100 calls a device,
    every full sample in a serving process), but what the launcher sets itself."""
    fields_ = {k: v for k, v in vars(reading).items() if k not in FROM_LAUNCHER}
    if reading.last_oom is not None:
        fields_["last_oom"] = asdict(reading.last_oom)
    return fields_


def reply(request_id: int, result: ProcessResult) -> dict[str, Any]:
    return {"type": "reply", "id": request_id, "result": result.to_dict()}


def command(request_id: int, action: str, params: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "command", "id": request_id, "action": action, "params": dict(params)}


def refused(reason: str) -> dict[str, Any]:
    return {"type": "refused", "reason": reason}


# -- validation (aggregator side) --------------------------------------------------------


def _fail(message: str) -> ProtocolError:
    return ProtocolError("field", message)


def _count(value: Any, what: str) -> int:
    # bool is an int in Python; a count is not.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES:
        raise _fail(f"{what}: expected a non-negative integer, got {str(value)[:32]!r}")
    return value


def _text(value: Any, what: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise _fail(f"{what}: expected text of at most {limit} characters")
    return value


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(f"{what}: expected an object")
    return value


def _counts(value: Any, what: str, allowed: tuple[str, ...] | None) -> dict[str, int]:
    result = {}
    for key, number in _object(value, what).items():
        if allowed is not None and key not in allowed:
            raise _fail(f"{what}: unknown key {key[:32]!r}")
        result[_text(key, what, 64)] = _count(number, f"{what}.{key[:32]}")
    return result


def parse_hello(message: Mapping[str, Any]) -> dict[str, str]:
    """The process labels an agent announces (the aggregator sets pid from the socket)."""
    if message.get("version") != VERSION:
        raise ProtocolError("version", f"protocol version {message.get('version')!r}")
    process = _object(message.get("process"), "process")
    return {name: _text(process.get(name, ""), name, 64) for name in PROCESS_LABELS}


def _device(value: Any) -> int:
    device = _count(value, "device")
    if device > 1023:
        raise _fail("device: out of range")
    return device


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(f"{what}: expected true or false")
    return value


def _optional_count(value: Any, what: str) -> int | None:
    return None if value is None else _count(value, what)


def _pools(value: Any) -> dict[str, dict[str, int]]:
    pools = {}
    for pool, gauges in _object(value, "pools").items():
        if pool not in _POOLS:
            raise _fail(f"pools: unknown pool {pool[:32]!r}")
        pools[pool] = _counts(gauges, f"pools.{pool}", POOL_GAUGES)
    return pools


def _private_pools(value: Any) -> dict[str, dict[str, int]]:
    pools = _object(value, "private_pools")
    if len(pools) > MAX_PRIVATE_POOLS:
        raise _fail("private_pools: too many pools")
    return {
        _text(pool, "private_pools", 64): _counts(
            gauges, "private_pools.<pool>", PRIVATE_POOL_GAUGES
        )
        for pool, gauges in pools.items()
    }


def _components(value: Any) -> dict[str, int]:
    components = _object(value, "components")
    if len(components) > MAX_COMPONENTS + 1:  # the bound, and its overflow
        raise _fail("components: too many")
    return {
        _component_name(name): _count(nbytes, "components.<name>")
        for name, nbytes in components.items()
    }


def _component_name(name: Any) -> str:
    """The rules exporter.set_component() applies at the call (a ledger part's name is
    refused: it would give two series with one label set), and the overflow's own name."""
    if name == OVERFLOW:
        return OVERFLOW
    try:
        return check_name(_text(name, "components", MAX_NAME))
    except ComponentError as exc:
        raise _fail(f"components: {exc}") from None


def _private_pool_info(value: Any) -> dict[str, dict[str, str]]:
    pools = _object(value, "private_pool_info")
    if len(pools) > MAX_PRIVATE_POOLS:
        raise _fail("private_pool_info: too many pools")
    found = {}
    for pool, described in pools.items():
        described = _object(described, "private_pool_info.<pool>")
        if set(described) - {"kind", "name"} or described.get("kind", "") not in POOL_KINDS:
            raise _fail("private_pool_info: a pool is {kind: graph|mempool, name}")
        found[_text(pool, "private_pool_info", 64)] = {
            "kind": described.get("kind", ""),
            "name": _text(described.get("name", ""), "private_pool_info.<name>", MAX_NAME),
        }
    return found


def _settings(value: Any) -> dict[str, str]:
    settings = _object(value, "settings")
    if len(settings) > MAX_SETTINGS:
        raise _fail("settings: too many keys")
    return {
        _text(key, "settings", 64): _text(text, "settings.<value>", 64)
        for key, text in settings.items()
    }


# How the launcher checks each part of an agent's allocator reading, by the reading's field
# (exporter.sample.AllocatorReading declares them; tests/transport/test_protocol.py holds the two
# equal, so a new field is checked here or the test fails). A field absent from a message
# keeps its declared default. `process` is never taken from an agent: the launcher sets it.
ALLOCATOR_CHECKS: dict[str, Callable[[Any], Any]] = {
    "device": _device,
    "gpu_uuid": lambda v: _text(v, "gpu_uuid", 128),
    "backend": lambda v: _text(v, "backend", 32),
    "expandable_segments": lambda v: _flag(v, "expandable_segments"),
    "gauges": lambda v: _counts(v, "gauges", ALLOCATOR_GAUGES),
    "counters": lambda v: _counts(v, "counters", ALLOCATOR_COUNTERS),
    "pools": _pools,
    "max_split_size_bytes": lambda v: _optional_count(v, "max_split"),
    "layout": lambda v: _counts(v, "layout", LAYOUT_GAUGES),
    "layout_age_s": lambda v: _age(v, "layout_age_s"),
    "layout_skipped": lambda v: _text(v, "layout_skipped", 32),
    "private_pools": _private_pools,
    "settings": _settings,
    "non_allocator_bytes": lambda v: _optional_count(v, "non_allocator_bytes"),
    "non_allocator_age_s": lambda v: _age(v, "non_allocator_age_s"),
    "last_oom": lambda v: _last_oom(v),
    "ooms_by_verdict": lambda v: _counts(v, "ooms_by_verdict", VERDICTS),
    "components": _components,
    "private_pool_info": _private_pool_info,
}
FROM_LAUNCHER = ("process",)
_REQUIRED = tuple(
    f.name
    for f in fields(AllocatorReading)
    if f.default is MISSING and f.default_factory is MISSING
)


def parse_allocator(data: Any) -> AllocatorReading:
    data = _object(data, "allocator")
    unknown = set(data) - set(ALLOCATOR_CHECKS) - set(FROM_LAUNCHER)
    if unknown:
        raise _fail(f"allocator: unknown fields {sorted(unknown)[:3]}")
    checked = {}
    for name, check in ALLOCATOR_CHECKS.items():
        if name in data:
            checked[name] = check(data[name])
        elif name in _REQUIRED:
            checked[name] = check(None)  # says what it expected
    return AllocatorReading(**checked)


def _last_oom(value: Any) -> OomVerdict | None:
    if value is None:
        return None
    try:
        return OomVerdict.from_dict(_object(value, "last_oom"))
    except ValueError as exc:
        raise _fail(f"last_oom: {exc}") from None


def _age(value: Any, what: str) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e9
    ):
        raise _fail(f"{what}: expected a non-negative number of seconds")
    return None if value is None else float(value)


def parse_pinned_host(message: Mapping[str, Any]) -> PinnedHostReading | None:
    """The pinned host memory a sample message reports for its process, if any."""
    data = message.get("pinned_host")
    if data is None:
        return None
    data = _object(data, "pinned_host")
    if set(data) - {"held_bytes", "in_use_bytes"}:
        raise _fail("pinned_host: unknown fields")
    return PinnedHostReading(
        held_bytes=_count(data.get("held_bytes"), "pinned_host.held_bytes"),
        in_use_bytes=_count(data.get("in_use_bytes"), "pinned_host.in_use_bytes"),
    )


def parse_sample(message: Mapping[str, Any]) -> tuple[list[AllocatorReading], ActionCounts]:
    allocators = message.get("allocators")
    if not isinstance(allocators, list) or len(allocators) > MAX_ALLOCATORS:
        raise _fail(f"allocators: expected a list of at most {MAX_ALLOCATORS}")
    readings = [parse_allocator(a) for a in allocators]
    devices = [r.device for r in readings]
    if len(set(devices)) != len(devices):  # the same series twice: a scrape Prometheus drops
        raise _fail("allocators: a device appears twice")
    actions = _object(message.get("actions", {}), "actions")
    counts = ActionCounts(
        snapshots=_counts(actions.get("snapshots", {}), "actions.snapshots", None),
        empty_cache_released_bytes=_count(
            actions.get("empty_cache_released_bytes", 0), "actions.empty_cache_released_bytes"
        ),
        remediations=_counts(actions.get("remediations", {}), "actions.remediations", None),
        records_dropped=_count(actions.get("records_dropped", 0), "actions.records_dropped"),
        helper_restarts=_count(actions.get("helper_restarts", 0), "actions.helper_restarts"),
        component_problems=_counts(
            actions.get("component_problems", {}), "actions.component_problems", PROBLEMS
        ),
    )
    if len(counts.snapshots) > 16 or len(counts.remediations) > 16:
        raise _fail("actions: too many keys")
    return readings, counts


def parse_reply(message: Mapping[str, Any]) -> tuple[int, ProcessResult]:
    request_id = _count(message.get("id"), "id")
    data = _object(message.get("result"), "result")
    ok = data.get("ok")
    if not isinstance(ok, bool):
        raise _fail("result.ok: expected true or false")
    result = data.get("result")
    if result is not None:
        _object(result, "result.result")
    error = data.get("error")
    if error is not None:
        error = _text(error, "result.error", 4096)
    outcome = data.get("outcome", "ok")
    if outcome not in OUTCOME_STATUS:
        raise _fail(f"result.outcome: unknown {str(outcome)[:32]!r}")
    retry = data.get("retry_after_s")
    if retry is not None and (
        isinstance(retry, bool) or not isinstance(retry, (int, float)) or not math.isfinite(retry)
    ):
        raise _fail("result.retry_after_s: expected a number")
    return request_id, ProcessResult(
        process={}, ok=ok, result=result, error=error, outcome=outcome, retry_after_s=retry
    )


def parse_command(message: Mapping[str, Any]) -> tuple[int, str, dict[str, Any]]:
    request_id = _count(message.get("id"), "id")
    action = message.get("action")
    if action not in BY_NAME:
        raise _fail(f"unknown action {str(action)[:32]!r}")
    return request_id, str(action), _object(message.get("params", {}), "params")
