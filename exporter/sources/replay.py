"""Replay: plays back a trace recorded on a real GPU at the pace it was recorded, looping.

So that a replay looks like one long-lived process to Prometheus, counters keep rising across
loops (each loop adds the trace's own increase, which makes the seam continuous), lifetime
peaks never drop below the trace's highest peak once it has been reached, and only the first
loop plays the recording's first sample (its start: the process before it held anything).
"""

from __future__ import annotations

import bisect
import copy
import time
from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from exporter.oom_verdict import OomVerdict
from exporter.pools import PoolNames
from exporter.sample import AllocatorReading, HostProcessReading, Sample, SourceReading
from exporter.trace import read_trace

DEMO_TRACE = "demo_trace.jsonl.gz"
DEMO_SNAPSHOTS = "demo_snapshots"


def demo_trace_path() -> Path:
    """The trace shipped inside the package (recorded by scripts/record_demo_trace.py)."""
    return Path(str(resources.files("exporter") / "data" / DEMO_TRACE))


def demo_snapshots_folder() -> Path:
    """The snapshots recorded with the packaged trace (its index.json names them)."""
    return Path(str(resources.files("exporter") / "data" / DEMO_SNAPSHOTS))


class ReplaySource:
    name = "replay"
    # The demo has nothing else to serve: its failing makes /healthz fail (Sampler.failing_sources).
    required = True

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        loop: bool = True,
        speed: float = 1.0,
        snapshots: str | Path | None = None,
    ) -> None:
        """`snapshots`: the folder of snapshots recorded with the trace (its index.json);
        the packaged one for the packaged trace, none for another trace unless given."""
        if not speed > 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.path = Path(path) if path is not None else demo_trace_path()
        if snapshots is not None:
            self.snapshots: Path | None = Path(snapshots)
        else:
            self.snapshots = demo_snapshots_folder() if path is None else None
        self.meta, self._samples = read_trace(self.path)
        derive_recorded_non_allocator(self._samples)
        derive_recorded_pool_kinds(self._samples)
        self._clock = clock
        self._loop = loop
        self._speed = speed
        t0 = self._samples[0].timestamp
        self._offsets = [s.timestamp - t0 for s in self._samples]
        step = (self._offsets[-1] / (len(self._samples) - 1)) if len(self._samples) > 1 else 1.0
        # One loop lasts the recording plus one sampling step, so the last sample gets its turn.
        self.duration_s = self._offsets[-1] + step
        first, last = self._samples[0], self._samples[-1]
        self._counter_increase = _increase(first, last, lambda r: r.counters)
        self._verdict_increase = _increase(first, last, lambda r: r.ooms_by_verdict)
        self._peak_max = _peak_max(self._samples)
        self._started: float | None = None
        # Replayed OOM verdicts: their replayed time by recorded time in the loop being
        # played, and the latest by device (exporter.oom_verdict).
        self._oom_loop = 0
        self._oom_times: dict[float, float] = {}
        self._last_ooms: dict[_Key, OomVerdict] = {}

    @property
    def finished(self) -> bool:
        """True once a non-looping replay has played its last sample."""
        return (
            not self._loop
            and self._started is not None
            and self._clock() - self._started >= self.duration_s
        )

    def position(self) -> tuple[int, int]:
        """(loop number, sample index) for the current time."""
        if self._started is None:
            self._started = self._clock()
        elapsed = (self._clock() - self._started) * self._speed
        loop, offset = divmod(elapsed, self.duration_s)
        if not self._loop and loop >= 1:
            return 0, len(self._samples) - 1
        index = max(bisect.bisect_right(self._offsets, offset) - 1, 0)
        if loop >= 1 and index == 0 and len(self._samples) > 1:
            # Later loops start at the second sample: the first is the recording's start (the
            # demo's server before it loaded anything, 0 bytes allocated), and a long-lived
            # process does not go back to it for a tick at every loop.
            index = 1
        return int(loop), index

    def recorded_process(self) -> dict[str, str]:
        """The recorded server's process labels (catalog.PROCESS_LABELS), as the page names
        it: the demo's actions answer as that process."""
        first = self._samples[0]
        hosts = first.host_processes or _recorded_process(first)
        own = next((p for p in hosts if p.pid == first.self_pid), None)
        return {
            "pid": str(first.self_pid) if first.self_pid is not None else "",
            "rank": own.rank if own else "",
            "local_rank": "",
            "role": own.role if own else "",
        }

    def recorded_ooms(self) -> list[tuple[float, float, int, OomVerdict]]:
        """Each recorded OOM verdict that links a snapshot: (second of the trace it is first
        seen at, second of the OOM, device, verdict), in order."""
        t0 = self._samples[0].timestamp
        found: dict[str, tuple[float, float, int, OomVerdict]] = {}
        for sample in self._samples:
            for reading in sample.allocators:
                verdict = reading.last_oom
                if verdict is not None and verdict.snapshot and verdict.snapshot not in found:
                    seen, at = sample.timestamp - t0, verdict.timestamp - t0
                    found[verdict.snapshot] = (seen, at, reading.device, verdict)
        return sorted(found.values(), key=lambda entry: entry[0])

    def moment(self) -> float:
        """The second of the trace being replayed now (from its first sample)."""
        return self._offsets[self.position()[1]]

    def read(self) -> SourceReading:
        loop, index = self.position()
        recorded = self._samples[index]
        allocators = copy.deepcopy(recorded.allocators)
        self._replay_ooms(loop, recorded, allocators)
        if loop:
            for reading in allocators:
                key = (reading.device, reading.gpu_uuid)
                for name, increase in self._counter_increase.get(key, {}).items():
                    if name in reading.counters:
                        reading.counters[name] += loop * increase
                verdicts = reading.ooms_by_verdict
                for name, increase in self._verdict_increase.get(key, {}).items():
                    verdicts[name] = verdicts.get(name, 0) + loop * increase
                for name, peak in self._peak_max.get(key, {}).items():
                    reading.gauges[name] = max(reading.gauges.get(name, 0), peak)
        parts = recorded.parts()
        del parts["allocators"]  # copied and moved on above
        played = SourceReading(allocators=allocators, **copy.deepcopy(parts))
        played.host_processes = played.host_processes or _recorded_process(recorded)
        return played

    def _replay_ooms(self, loop: int, recorded: Sample, allocators: list[AllocatorReading]) -> None:
        """A recorded OOM verdict is dated as long before its replayed moment as it was before
        the recorded one (fixed when first replayed, so that its series keeps one value), and
        the latest one stays on a device in the next loop, as it would in a live process."""
        for reading in allocators:
            key = (reading.device, reading.gpu_uuid)
            verdict = reading.last_oom
            if verdict is None:
                reading.last_oom = self._last_ooms.get(key)
                continue
            if self._oom_loop != loop:  # each loop dates its OOMs anew; the last loop's go
                self._oom_loop, self._oom_times = loop, {}
            dated = self._oom_times.get(verdict.timestamp)
            if dated is None:
                age = max(recorded.timestamp - verdict.timestamp, 0.0)
                dated = self._oom_times[verdict.timestamp] = time.time() - age / self._speed
            reading.last_oom = self._last_ooms[key] = replace(verdict, timestamp=dated)

    def close(self) -> None:
        pass


_Key = tuple[int, str]


def derive_recorded_non_allocator(samples: list[Sample]) -> None:
    """Traces recorded before processes took their non-allocator bytes themselves carry the
    parts: derive the value where the recorded process list was read on the tick of the
    allocator readings (which the recording exporter read tens of microseconds apart), and
    keep it, with its age, on the ticks that reused that list."""
    if any(r.non_allocator_bytes is not None for s in samples for r in s.allocators):
        return  # the trace carries the values
    taken: dict[tuple[str, int | None], tuple[int, float]] = {}
    for sample in samples:
        used = {(p.gpu_uuid, p.pid): p.used_bytes for p in sample.processes}
        for reading in sample.allocators:
            key = (reading.gpu_uuid, sample.allocator_pid(reading))
            reserved = reading.gauges.get("reserved_bytes")
            if not sample.processes_cached and reserved is not None and key in used:
                taken[key] = (max(used[key] - reserved, 0), sample.timestamp)
            if key in taken:
                value, at = taken[key]
                reading.non_allocator_bytes = value
                reading.non_allocator_age_s = max(sample.timestamp - at, 0.0)


def derive_recorded_pool_kinds(samples: list[Sample]) -> None:
    """Traces recorded before pools had kinds carry their ids: an unnamed pool's kind is its
    id's (exporter.pools), and no name."""
    unnamed = PoolNames()
    for sample in samples:
        for reading in sample.allocators:
            if reading.private_pools and not reading.private_pool_info:
                reading.private_pool_info = {
                    label: unnamed.describe(label) for label in reading.private_pools
                }


def _recorded_process(sample: Sample) -> list[HostProcessReading]:
    """Traces recorded before per-process host memory carry the recording process's own
    resident and peak bytes: that process, under the pid it had (swap was not recorded)."""
    host = sample.host
    if host is None or host.process_resident_bytes is None or sample.self_pid is None:
        return []
    return [
        HostProcessReading(
            pid=sample.self_pid,
            role="server",
            rank="",
            resident_bytes=host.process_resident_bytes,
            resident_peak_bytes=host.process_resident_peak_bytes,
        )
    ]


def _increase(
    first: Sample, last: Sample, counts: Callable[[AllocatorReading], dict[str, int]]
) -> dict[_Key, dict[str, int]]:
    """How much each count of each device rose over the trace (`counts`: the reading's counters,
    or its OOMs by verdict): a loop adds it again, so counts keep rising across loops."""
    start = {(a.device, a.gpu_uuid): counts(a) for a in first.allocators}
    result: dict[_Key, dict[str, int]] = {}
    for reading in last.allocators:
        key = (reading.device, reading.gpu_uuid)
        before = start.get(key, {})
        result[key] = {k: max(v - before.get(k, 0), 0) for k, v in counts(reading).items()}
    return result


def _peak_max(samples: list[Sample]) -> dict[_Key, dict[str, Any]]:
    result: dict[_Key, dict[str, Any]] = {}
    for sample in samples:
        for reading in sample.allocators:
            peaks = result.setdefault((reading.device, reading.gpu_uuid), {})
            for name in ("allocated_peak_bytes", "reserved_peak_bytes"):
                if name in reading.gauges:
                    peaks[name] = max(peaks.get(name, 0), reading.gauges[name])
    return result
