"""One connected process as the aggregator keeps it, and what its messages make of its
readings: a full sample replaces them; a probe record (exporter.probe.record) updates one
device's numbers over that device's latest full sample, whose settings, layout and verdicts
stay."""

from __future__ import annotations

import dataclasses
import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from exporter.probe import record
from exporter.sample import ActionCounts, AllocatorReading, PinnedHostReading
from exporter.sources.allocator_layout import bounded_pools, pool_label
from exporter.sources.process_memory import read_environ
from exporter.transport import protocol

_CONNECTION_IDS = itertools.count(1)
# A record's parts that replace the reading's field of the same name (record.unpack): a new
# number a record carries into one of these needs nothing here.
RECORD_FIELDS = ("gauges", "counters", "pools", "max_split_size_bytes")
# A reading's ages, as of when it was read: they grow while it waits to be served.
AGES = ("layout_age_s", "non_allocator_age_s")


@dataclass
class Peer:
    sock: socket.socket
    pid: int
    id: int = field(default_factory=lambda: next(_CONNECTION_IDS))  # never reused, unlike fds
    connected_at: float = field(default_factory=time.monotonic)
    reader: protocol.StreamReader = field(default_factory=protocol.StreamReader)
    process: dict[str, str] = field(default_factory=dict)
    allocators: list[AllocatorReading] = field(default_factory=list)
    sampled_at: float = 0.0  # time.monotonic() when `allocators` arrived
    reported_at: float | None = None  # the same moment as Unix time, for /metrics
    counts: ActionCounts = field(default_factory=ActionCounts)
    pinned_host: PinnedHostReading | None = None
    # Each device's reading of the latest full sample, with the Unix time it came: what a
    # probe record's numbers update (its settings, layout and verdicts stay).
    full: dict[int, tuple[AllocatorReading, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Labels the process claimed that its start-up environment does not show (RANK set by
    # the process itself): they stand only while no other process has them
    # (Aggregator._hello).
    unbacked: set[str] = field(default_factory=set)

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.sock.sendall(protocol.encode(message))

    def quiet_s(self, now: float) -> float:
        """Seconds since the process last reported (or connected, before its first report)."""
        return now - (self.sampled_at or self.connected_at)

    def take_sample(self, message: dict[str, Any]) -> None:
        """A full sample: every device's reading, the action counts, pinned host memory."""
        readings, counts = protocol.parse_sample(message)
        for reading in readings:
            reading.process = dict(self.process)
        pinned = protocol.parse_pinned_host(message)
        if pinned is not None:
            pinned.process = dict(self.process)
        self.allocators, self.counts, self.pinned_host = readings, counts, pinned
        self._reported()
        self.full = {r.device: (r, self.reported_at) for r in readings}  # type: ignore[misc]

    def take_record(self, data: bytes) -> None:
        """A probe record: one device's numbers of one tick, over its latest full sample."""
        if not self.process:
            raise protocol.ProtocolError("order", "a record before hello")
        device, _, at, parts = record.unpack(data)
        full = self.full.get(device)
        if full is None:
            raise protocol.ProtocolError("order", f"a record of device {device} before its sample")
        base, base_at = full
        reading = dataclasses.replace(  # one copy of the reading: a record comes every tick
            base,
            private_pools=_fresher_private_pools(base, parts["private_pools"]),
            **{name: parts[name] for name in RECORD_FIELDS},
            **_ages(base, at - base_at),
        )
        others = [r for r in self.allocators if r.device != device]
        self.allocators = sorted([*others, reading], key=lambda r: r.device)
        if parts["pinned"] is not None:
            held, in_use = parts["pinned"]
            self.pinned_host = PinnedHostReading(held, in_use, process=dict(self.process))
        self._reported()

    def _reported(self) -> None:
        self.sampled_at, self.reported_at = time.monotonic(), time.time()


def _fresher_private_pools(
    base: AllocatorReading, raw: list[tuple[int, int, int]]
) -> dict[str, dict[str, int]]:
    """The full sample's private pools with a record's reserved bytes by pool over them
    (torch 2.13+: fresher than the layout's); the full sample's where the record has none."""
    if not raw:
        return base.private_pools
    fresh = {pool_label((first, second)): {"reserved_bytes": n} for first, second, n in raw}
    merged = {label: dict(values) for label, values in base.private_pools.items()}
    for label, values in bounded_pools(fresh).items():
        merged.setdefault(label, {}).update(values)
    return merged


def aged(reading: AllocatorReading, waited_s: float) -> AllocatorReading:
    """`reading` with its ages as of now: it was read `waited_s` ago."""
    ages = _ages(reading, waited_s)
    return dataclasses.replace(reading, **ages) if ages else reading


def _ages(reading: AllocatorReading, waited_s: float) -> dict[str, Any]:
    waited_s = max(waited_s, 0.0)
    return {name: age + waited_s for name in AGES if (age := getattr(reading, name)) is not None}


def environment_labels(pid: int, proc: str = "/proc") -> dict[str, str]:
    """rank and local_rank as the process was started with them (RANK, LOCAL_RANK in
    /proc/<pid>/environ): what a hello's claims are checked against. Only the variables that
    are there: a process may set RANK itself after it started (torch.multiprocessing workers
    often do), which /proc cannot show; such a claim is unbacked (Aggregator._hello)."""
    env = read_environ(pid, proc)
    return {
        label: env[name].decode(errors="replace")[:64]
        for label, name in (("rank", b"RANK"), ("local_rank", b"LOCAL_RANK"))
        if name in env
    }
