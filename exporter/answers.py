"""The admin API's answers as lines for people: the CLI's output unless --json asks for JSON.

An answer holds one entry per process of the server (exporter.actions.base.ProcessResult);
each successful one becomes a line naming the process, then its result's values, with bytes
and seconds in units a person reads. Failures are printed apart, on stderr, by the CLI.
"""

from __future__ import annotations

import time
import unicodedata
from typing import Any

from exporter.identity import describe_process
from exporter.oom_verdict import OomVerdict
from exporter.units import fmt_bytes


def terminal_safe(text: str, *, newlines: bool = True) -> str:
    """`text` with every control and format character escaped (\\x1b, \\u202e): what an
    exporter answers is printed to a terminal, where an escape sequence in a label or a
    verdict's text would retitle, clear or recolour it, and a bidi override would reorder what
    the on-call reads (round 4). Newlines stay where `newlines` (the output's own lines)."""
    if text.isprintable():
        return text
    out = []
    for char in text:
        if (char == "\n" and newlines) or unicodedata.category(char) not in ("Cc", "Cf"):
            out.append(char)
        elif ord(char) < 0x100:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}")
    return "".join(out)


def _value(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "none"}[value]
    if isinstance(value, dict):  # per device: {"0": bytes} -> "cuda:0 7.0 GiB"
        return ", ".join(f"{_device(k)} {_value(key, v)}" for k, v in value.items()) or "none"
    if isinstance(value, list):
        items = (_device(v) if key == "devices" else _value(key, v) for v in value)
        return ", ".join(items) or "none"
    if isinstance(value, (int, float)) and key.endswith("_bytes"):
        return fmt_bytes(value)
    if isinstance(value, (int, float)) and key.endswith("_s"):
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"
    return str(value)


def _device(key: Any) -> str:
    """A CUDA device number as the server's process names it."""
    return f"cuda:{key}" if str(key).isdigit() else str(key)


def _label(key: str) -> str:
    for suffix in ("_bytes", "_s"):
        if key.endswith(suffix):
            key = key[: -len(suffix)]
    return key.replace("_", " ")


def describe_result(result: Any) -> str:
    """One process's result on one line: "released 1.2 GiB; duration 12 ms; ..."."""
    if not isinstance(result, dict):
        return "done" if result is None else _value("", result)
    return "; ".join(f"{_label(k)} {_value(k, v)}" for k, v in result.items()) or "done"


def human_answer(answer: dict[str, Any]) -> str:
    """The lines for an answer (empty when no process succeeded: failures go to stderr)."""
    lines = []
    if answer.get("replay"):
        lines.append("replay of recorded data: nothing in a real process was changed")
    for entry in answer.get("processes", []):
        if entry.get("ok"):
            lines.append(
                f"{describe_process(entry.get('process') or {})}: "
                f"{describe_result(entry.get('result'))}"
            )
    if not answer.get("processes"):
        lines.append("no process of the server uses CUDA yet")
    return "".join(line + "\n" for line in lines)


def oom_answer(stats: dict[str, Any], base_url: str = "") -> str:
    """`gpumem-exporter why`: each process and device's OOMs, the latest with its verdict, the
    deciding numbers, the action and its snapshot (a URL on `base_url`, the exporter the
    answer came from, that opens in a browser); from GET /stats."""
    sample = stats.get("sample") or {}
    pending = {
        (str(row.get("pid")), row.get("device")): row
        for row in stats.get("ooms_pending") or []
        if isinstance(row, dict)
    }
    lines = []
    for allocator in sample.get("allocators", []):
        ooms = int((allocator.get("counters") or {}).get("ooms", 0))
        last = allocator.get("last_oom")
        if not ooms and not last:
            continue
        process = allocator.get("process") or {"pid": str(sample.get("self_pid") or "?")}
        where = f"{describe_process(process)} cuda:{allocator.get('device')}"
        counts = allocator.get("ooms_by_verdict") or {}
        by_verdict = ", ".join(f"{v} {n}" for v, n in sorted(counts.items()))
        lines.append(f"{where}: {ooms} OOM(s)" + (f" ({by_verdict})" if by_verdict else ""))
        waiting = pending.get((str(process.get("pid")), allocator.get("device")))
        awaiting = int(waiting.get("count", 0)) if waiting else 0
        if waiting:
            at = time.strftime("%H:%M:%S UTC", time.gmtime(float(waiting.get("since", 0))))
            lines.append(
                f"  verdict pending: {awaiting} OOM(s) since {at} (the OOM observer is taking "
                "its readings; ask again in a few seconds)"
            )
        if ooms - awaiting > sum(counts.values()):
            lines.append(
                f"  {ooms - awaiting - sum(counts.values())} without a verdict (before the OOM "
                "observer was armed, or recorded by an older exporter)"
            )
        if last:
            lines.extend(_verdict_lines(OomVerdict.from_dict(last), base_url))
    if not lines:
        return "no out-of-memory error in any process since the exporter started\n"
    return "".join(line + "\n" for line in lines)


def ledger_answer(stats: dict[str, Any]) -> str:
    """Where each process's memory on each GPU goes (/stats' ledgers): one line a device, the
    total (NVML's per-process used where the process has a value outside the allocator)."""
    lines = []
    self_pid = (stats.get("sample") or {}).get("self_pid")
    for row in stats.get("ledgers") or []:
        parts = row.get("parts") if isinstance(row, dict) else None
        if not isinstance(parts, dict) or not parts:
            continue
        # A single process's reading names no process: the sample's own pid, as oom_answer.
        process = row.get("process") or {"pid": str(self_pid or "?")}
        where = f"{describe_process(process)} cuda:{row.get('device')}"
        total = sum(int(value) for value in parts.values())
        terms = " + ".join(f"{name} {fmt_bytes(int(value))}" for name, value in parts.items())
        lines.append(f"{where}: {fmt_bytes(total)} = {terms}")
    if not lines:
        return ""
    return "where the memory goes:\n" + "".join(f"  {line}\n" for line in lines)


def _verdict_lines(verdict: OomVerdict, base_url: str) -> list[str]:
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(verdict.timestamp))
    followed = (
        f" (the burst's most complete record; {verdict.followed} more OOM(s) followed)"
        if verdict.followed
        else ""
    )
    lines = [
        f"  latest at {at}: {verdict.verdict}{followed}",
        f"    why: {verdict.reason}",
        f"    do:  {verdict.action}",
    ]
    if verdict.missing:
        lines.append(f"    not read: {verdict.missing}")
    if verdict.snapshot:
        lines.append(f"    snapshot: {base_url}/snapshots/{verdict.snapshot}/view")
    return lines
