"""Why a process ran out of GPU memory: one verdict per OOM, from readings of that moment.

PyTorch calls its OOM observer on the OOM-ing thread after the allocator has flushed its free
cached segments and retried (docs/facts.md). What is left of the cache then is free bytes in
segments that also hold live tensors ("holes"): cache that could not be given back. With the
request, the device's free memory, the process's cap and what other processes hold on the GPU,
the cause is decided by the first rule that holds, in this order (RULES: one row a cause, its
condition, the readings it needs and what it says; a new cause is one row):

- `fragmentation`: free bytes in holes >= R (the cache had enough, in pieces too small).
  Action: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (or uniform sizes where it is on).
- `pools`: free bytes stranded in private pools (live `torch.cuda.MemPool`s', CUDA graphs')
  cover what was missing (R minus the room the cap or the GPU left). Action: delete the pool's
  owner, or allocate from it (the pools are named).
- `cap`: a cap is set (fraction < 1) and the GPU's free memory >= R. Action: raise the
  fraction to the cap named.
- `other_processes`: other processes hold >= 10 % of the GPU, and their bytes plus the GPU's
  free memory >= R. Action: stop or move them (the biggest is named).
- `outside_allocator`: this process holds >= 10 % of the GPU outside PyTorch's allocator
  (NVML's per-process used - reserved: CuPy, NCCL, CuMem pools), and those bytes plus the
  GPU's free memory >= R. Action: free or bound that allocator.
- `exhaustion`: none of the above, with every reading known: live tensors fill the memory the
  process may use. Action: a smaller batch, sequence or KV-cache budget.
- `unknown`: a reading a rule needs is missing (named in `missing`). Action: the snapshot.

(R: the requested bytes.) A rule needs only its own readings: a missing NVML process list
makes the verdict `unknown` only where no earlier rule decided it. Standard library only:
agents import this.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from exporter.units import fmt_bytes

VERDICTS = (
    "fragmentation",
    "pools",
    "cap",
    "other_processes",
    "outside_allocator",
    "exhaustion",
    "unknown",
)
# Other processes must hold at least this share of the GPU to be the verdict: a sidecar's CUDA
# context (~0.5 GiB) is not why a server filling an 80 GiB GPU ran out.
OTHER_PROCESSES_MIN_SHARE = 0.10
# The other processes named in a verdict (the biggest first).
MAX_NAMED_PROCESSES = 3
# This process's bytes outside the allocator must hold this share of the GPU to be the
# verdict: its CUDA context alone (~0.5 GiB) is not why it ran out.
OUTSIDE_ALLOCATOR_MIN_SHARE = 0.10
# The private pools named in a verdict (the most free bytes first).
MAX_NAMED_POOLS = 3
# The deciding bytes served as torch_cuda_oom_last_bytes{reading}: OomVerdict fields by name.
READINGS = (
    "requested",
    "free_in_holes",
    "largest_free_block",
    "allocated",
    "reserved",
    "cap_room",  # after reserved: a scrape read back (exporter.record) needs reserved first
    "device_free",
    "other_processes",
    "private_pools_free",
    "outside_allocator",
)


@dataclass(frozen=True)
class OomVerdict:
    """One OOM: the readings taken in PyTorch's OOM observer and the verdict they give.
    A reading is None where it could not be taken (`missing` says why)."""

    device: int
    timestamp: float  # Unix time of the OOM
    requested_bytes: int
    verdict: str = "unknown"
    reason: str = ""  # the deciding numbers, in one line for people
    action: str = ""  # what to do, in one line
    reserved_bytes: int | None = None
    allocated_bytes: int | None = None
    # Free bytes left in the cache after PyTorch's flush: holes between live blocks.
    free_in_holes_bytes: int | None = None
    largest_free_block_bytes: int | None = None
    # The allocator's cap (set_per_process_memory_fraction x total); None without a cap.
    memory_limit_bytes: int | None = None
    device_total_bytes: int | None = None
    device_free_bytes: int | None = None  # cudaMemGetInfo in the allocator, at the OOM
    other_processes_bytes: int | None = None  # NVML: the GPU's other processes, together
    # [pid, bytes], the biggest first (at most MAX_NAMED_PROCESSES)
    other_processes: list[list[int]] = field(default_factory=list)
    # Free bytes in private pools (MemPools', CUDA graphs'), from the OOM's snapshot: memory
    # the default pool cannot use; and by pool id ("0_1"), the most first.
    private_pools_free_bytes: int | None = None
    private_pools_free: dict[str, int] = field(default_factory=dict)
    # The names the server gave those pools (exporter.name_pool), by pool id: "decode_graphs".
    private_pool_names: dict[str, str] = field(default_factory=dict)
    # This process's bytes outside PyTorch's allocator at the OOM: NVML's used - reserved.
    outside_allocator_bytes: int | None = None
    expandable_segments: bool = False
    missing: str = ""  # the readings that could not be taken, "name: why; ..."
    snapshot: str = ""  # id of the allocator snapshot taken at this OOM, when one was
    observe_s: float = 0.0  # time the observer took on the OOM-ing thread
    # OOMs of the same burst after this one (OomLog keeps the burst's most complete record:
    # later OOMs of a storm lack the snapshot, and often the layout's readings).
    followed: int = 0

    @property
    def cap_room_bytes(self) -> int | None:
        """What the cap left this process: limit - reserved (None without a cap)."""
        if self.memory_limit_bytes is None or self.reserved_bytes is None:
            return None
        return max(self.memory_limit_bytes - self.reserved_bytes, 0)

    def deciding_bytes(self) -> dict[str, int]:
        """READINGS that were taken, by name (torch_cuda_oom_last_bytes)."""
        values = {name: _reading(self, name) for name in READINGS}
        return {name: value for name, value in values.items() if value is not None}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cap_room_bytes": self.cap_room_bytes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OomVerdict:
        """From to_dict()'s output (a trace, an agent's message); ValueError if malformed."""
        if not isinstance(data, Mapping):
            raise ValueError("an OOM verdict is an object")
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                continue  # derived (cap_room_bytes) or from a newer version
            values[name] = _checked(name, value)
        try:
            verdict = cls(**values)
        except TypeError as exc:
            raise ValueError(f"OOM verdict: {exc}") from None
        if verdict.verdict not in VERDICTS:
            raise ValueError(f"OOM verdict: unknown verdict {verdict.verdict!r}")
        return verdict


def _reading(verdict: OomVerdict, name: str) -> int | None:
    value = getattr(verdict, f"{name}_bytes")
    return None if value is None else int(value)


_TEXT = ("verdict", "reason", "action", "missing", "snapshot")
_FLOAT = ("timestamp", "observe_s")


def _checked(name: str, value: Any) -> Any:
    """One field's value, if it has the field's type (agents' messages are untrusted)."""
    if name in _TEXT:
        if not isinstance(value, str) or len(value) > 2000:
            raise ValueError(f"OOM verdict: {name} is not a short text")
        return value
    if name == "expandable_segments":
        if not isinstance(value, bool):
            raise ValueError("OOM verdict: expandable_segments is not a boolean")
        return value
    if name == "private_pools_free":
        if not isinstance(value, dict) or len(value) > MAX_NAMED_POOLS:
            raise ValueError("OOM verdict: private_pools_free is not a short mapping")
        if not all(isinstance(k, str) and len(k) <= 64 and _whole(v) for k, v in value.items()):
            raise ValueError("OOM verdict: private_pools_free maps pool ids to bytes")
        return dict(value)
    if name == "private_pool_names":
        if not isinstance(value, dict) or len(value) > MAX_NAMED_POOLS:
            raise ValueError("OOM verdict: private_pool_names is not a short mapping")
        short = all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 64
            for k, v in value.items()
        )
        if not short:
            raise ValueError("OOM verdict: private_pool_names maps pool ids to names")
        return dict(value)
    if name == "other_processes":
        if not isinstance(value, list) or len(value) > MAX_NAMED_PROCESSES:
            raise ValueError("OOM verdict: other_processes is not a short list")
        pairs = [list(p) for p in value if isinstance(p, (list, tuple)) and len(p) == 2]
        if len(pairs) != len(value) or not all(_whole(x) for p in pairs for x in p):
            raise ValueError("OOM verdict: other_processes holds [pid, bytes] pairs")
        return pairs
    if name in _FLOAT:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not 0 <= value < 1e12:  # NaN fails both comparisons
            raise ValueError(f"OOM verdict: {name} is not a non-negative number")
        return float(value)
    if value is None and name not in ("device", "requested_bytes", "followed"):
        return None
    if not _whole(value):
        raise ValueError(f"OOM verdict: {name} is not a whole number")
    return value


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def decide(verdict: OomVerdict) -> OomVerdict:
    """The verdict of these readings (module docstring), with its reason and action."""
    name, reason, action = _rule(verdict)
    return replace(verdict, verdict=name, reason=reason, action=action)


@dataclass(frozen=True)
class Rule:
    """One cause: asked in RULES' order, the first that holds is the verdict. A rule asked
    whose `needs` (field, what it is) lacks a reading gives `unknown`, naming it: the rules
    after it cannot be told apart from it without that reading."""

    verdict: str
    holds: Callable[[OomVerdict], bool]  # with its needs read
    says: Callable[[OomVerdict], tuple[str, str]]  # (reason, action), where it holds
    needs: tuple[tuple[str, str], ...] = ()
    asked: Callable[[OomVerdict], bool] = lambda v: True  # whether it applies at all


def _rule(v: OomVerdict) -> tuple[str, str, str]:
    for rule in RULES:
        if not rule.asked(v):
            continue
        for name, what in rule.needs:
            if getattr(v, name) is None:
                return _unknown(v, what)
        if rule.holds(v):
            reason, action = rule.says(v)
            return rule.verdict, reason, action
    raise AssertionError("exhaustion holds whenever it is reached")


def _capped(v: OomVerdict) -> bool:
    """A cap under the GPU's size (set_per_process_memory_fraction < 1)."""
    return v.memory_limit_bytes is not None and (
        v.device_total_bytes is None or v.memory_limit_bytes < v.device_total_bytes
    )


def _share(v: OomVerdict, nbytes: int | None) -> float:
    total = v.device_total_bytes or 0
    return nbytes / total if nbytes is not None and total else 0.0


# 1. The cache had the bytes, in pieces.


def _fragmented(v: OomVerdict) -> bool:
    assert v.free_in_holes_bytes is not None
    return v.free_in_holes_bytes >= v.requested_bytes


def _fragmentation(v: OomVerdict) -> tuple[str, str]:
    assert v.free_in_holes_bytes is not None
    largest = v.largest_free_block_bytes
    piece = f", largest free block {fmt_bytes(largest)}" if largest is not None else ""
    reason = (
        f"asked {fmt_bytes(v.requested_bytes)}; {fmt_bytes(v.free_in_holes_bytes)} free in "
        f"the cache between live tensors{piece}"
    )
    if v.expandable_segments:
        action = (
            "holes between live tensors even with expandable segments: make allocation "
            "sizes uniform (pad or bucket batch shapes), free long-lived tensors made "
            "between short-lived ones"
        )
    else:
        action = (
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and restart "
            "(empty_cache cannot merge holes between live tensors)"
        )
    return reason, action


# 2. Free memory stranded in private pools would have covered what was missing: the request
# less the room the cap (or, without one, the GPU) left.


def _pool_room(v: OomVerdict) -> int | None:
    return v.cap_room_bytes if _capped(v) else v.device_free_bytes


def _stranded(v: OomVerdict) -> bool:
    stranded, room = v.private_pools_free_bytes, _pool_room(v)
    if not stranded or room is None:
        return False
    return stranded >= v.requested_bytes - room


def _pools(v: OomVerdict) -> tuple[str, str]:
    stranded, room = v.private_pools_free_bytes, _pool_room(v)
    assert stranded is not None and room is not None
    named = ", ".join(
        f"pool {pool_label(pool, v.private_pool_names)} {fmt_bytes(free)}"
        for pool, free in v.private_pools_free.items()
    )
    reason = (
        f"asked {fmt_bytes(v.requested_bytes)}; {fmt_bytes(stranded)} free in private pools "
        f"the default pool cannot use ({named}), {fmt_bytes(room)} room left"
    )
    action = (
        "delete what owns the pool (the torch.cuda.MemPool or CUDA graph), then "
        "torch.cuda.empty_cache(); or allocate this request from it (torch.cuda.use_mem_pool)"
    )
    return reason, action


def pool_label(pool: str, names: Mapping[str, str]) -> str:
    """A private pool as people read it: its name and id where the server named it
    ("decode_graphs (0_1)"), else its id."""
    name = names.get(pool)
    return f"{name} ({pool})" if name else pool


# 3. The GPU had room; the process's cap did not.


def _gpu_had_room(v: OomVerdict) -> bool:
    assert v.device_free_bytes is not None
    return v.device_free_bytes >= v.requested_bytes


def _cap(v: OomVerdict) -> tuple[str, str]:
    assert v.memory_limit_bytes is not None and v.device_free_bytes is not None
    room = v.cap_room_bytes
    reason = (
        f"asked {fmt_bytes(v.requested_bytes)}; the GPU had {fmt_bytes(v.device_free_bytes)} "
        f"free but the cap of {fmt_bytes(v.memory_limit_bytes)} left "
        f"{fmt_bytes(room) if room is not None else 'unknown'}"
    )
    need = (v.reserved_bytes or v.memory_limit_bytes) + v.requested_bytes
    of_gpu = f" ({need / v.device_total_bytes:.2f})" if v.device_total_bytes else ""
    action = (
        f"raise torch.cuda.set_per_process_memory_fraction to a cap of at least "
        f"{fmt_bytes(need)}{of_gpu}, or lower this process's memory use"
    )
    return reason, action


# 4. Other processes hold what was missing.


def _others_hold_it(v: OomVerdict) -> bool:
    assert v.other_processes_bytes is not None and v.device_free_bytes is not None
    return (
        _share(v, v.other_processes_bytes) >= OTHER_PROCESSES_MIN_SHARE
        and v.other_processes_bytes + v.device_free_bytes >= v.requested_bytes
    )


def _other_processes(v: OomVerdict) -> tuple[str, str]:
    assert v.other_processes_bytes is not None and v.device_free_bytes is not None
    named = ", ".join(f"pid {pid} {fmt_bytes(used)}" for pid, used in v.other_processes)
    reason = (
        f"asked {fmt_bytes(v.requested_bytes)}; {fmt_bytes(v.device_free_bytes)} free on the "
        f"GPU, other processes hold {fmt_bytes(v.other_processes_bytes)} ({named})"
    )
    first = v.other_processes[0][0] if v.other_processes else None
    who = f"pid {first}" if first is not None else "the other processes"
    return reason, f"stop or move {who} off this GPU"


# 5. This process's memory outside the allocator filled the GPU.


def _outside_fills_it(v: OomVerdict) -> bool:
    outside, free = v.outside_allocator_bytes, v.device_free_bytes
    return (
        outside is not None
        and free is not None
        and _share(v, outside) >= OUTSIDE_ALLOCATOR_MIN_SHARE
        and outside + free >= v.requested_bytes
    )


def _outside_allocator(v: OomVerdict) -> tuple[str, str]:
    assert v.outside_allocator_bytes is not None and v.device_free_bytes is not None
    reason = (
        f"asked {fmt_bytes(v.requested_bytes)}; {fmt_bytes(v.device_free_bytes)} free on the "
        f"GPU, this process holds {fmt_bytes(v.outside_allocator_bytes)} outside PyTorch's "
        "allocator"
    )
    action = (
        "free or bound the other allocator in this process (CuPy: "
        "cupy.get_default_memory_pool().free_all_blocks() or set_limit; NCCL buffers; a "
        "CuMem/VMM pool), or give torch's allocator less of the GPU"
    )
    return reason, action


# 6. Live tensors fill what this process may use.


def _exhaustion(v: OomVerdict) -> tuple[str, str]:
    assert v.allocated_bytes is not None and v.free_in_holes_bytes is not None
    assert v.device_free_bytes is not None
    capped = _capped(v)
    room = v.memory_limit_bytes if capped else v.device_total_bytes
    of = f" of {fmt_bytes(room)}" + (" (the cap)" if capped else "") if room else ""
    reason = (
        f"asked {fmt_bytes(v.requested_bytes)}; live tensors hold "
        f"{fmt_bytes(v.allocated_bytes)}{of}, {fmt_bytes(v.free_in_holes_bytes)} free in the "
        f"cache, {fmt_bytes(v.device_free_bytes)} free on the GPU"
    )
    action = "reduce the batch size, sequence length or KV-cache budget, or shard the model wider"
    return reason, action


_FREE_ON_GPU = ("device_free_bytes", "the GPU's free memory")
# The module docstring's order; `unknown` is no row: it is what a missing need gives.
RULES = (
    Rule(
        "fragmentation",
        _fragmented,
        _fragmentation,
        needs=(("free_in_holes_bytes", "free bytes in the cache"),),
    ),
    Rule("pools", _stranded, _pools),
    Rule("cap", _gpu_had_room, _cap, needs=(_FREE_ON_GPU,), asked=_capped),
    Rule(
        "other_processes",
        _others_hold_it,
        _other_processes,
        needs=(_FREE_ON_GPU, ("other_processes_bytes", "the GPU's other processes (NVML)")),
    ),
    Rule("outside_allocator", _outside_fills_it, _outside_allocator),
    Rule(
        "exhaustion", lambda v: True, _exhaustion, needs=(("allocated_bytes", "allocated bytes"),)
    ),
)


def _unknown(v: OomVerdict, needed: str) -> tuple[str, str, str]:
    why = f" ({v.missing})" if v.missing else ""
    reason = f"asked {fmt_bytes(v.requested_bytes)}; {needed} could not be read at the OOM{why}"
    return "unknown", reason, "open the snapshot taken at the OOM to see the cache's blocks"


# Before any OOM: what allocation retries (cudaMalloc failed, the cache was flushed) say is
# building. The same thresholds as the Prometheus rule GpuMemAllocRetries' description.
RETRY_SHATTERED_SHARE = 0.25  # largest free block under this share of the free holes
RETRY_SHATTERED_MIN_BYTES = 512 << 20
RETRY_CAP_ROOM_SHARE = 0.05  # less than this share of the cap left


def retry_pressure(
    free_in_holes: int | None,
    largest_free_block: int | None,
    reserved: int | None,
    limit: int | None,
    last_oom: OomVerdict | None = None,
) -> str:
    """What an allocation retry is the step before, in words ("" where nothing says):
    "fragmentation building" when the free cache is in small pieces, "close to the cap" when
    the process's cap (or the device, without one) has little room left. Where the process
    already had an OOM, its verdict (taken at the OOM, with every reading) leads and only
    the note that agrees with it stays: one diagnosis on one screen."""
    notes = []  # (the verdict the note points at, the note)
    if (
        free_in_holes is not None
        and largest_free_block is not None
        and free_in_holes > RETRY_SHATTERED_MIN_BYTES
        and largest_free_block < RETRY_SHATTERED_SHARE * free_in_holes
    ):
        notes.append(
            (
                "fragmentation",
                f"fragmentation building: {fmt_bytes(free_in_holes)} free between live "
                f"tensors, largest piece {fmt_bytes(largest_free_block)}",
            )
        )
    if limit and reserved is not None and limit - reserved < RETRY_CAP_ROOM_SHARE * limit:
        room = fmt_bytes(max(limit - reserved, 0))
        notes.append(("cap", f"close to the cap: {room} left under it"))
    if last_oom is None:
        return "; ".join(note for _, note in notes)
    lead = f"its latest OOM: {last_oom.verdict} (the banner has the numbers)"
    return "; ".join([lead, *(note for cause, note in notes if cause == last_oom.verdict)])


def describe(verdict: OomVerdict) -> str:
    """The verdict in one line for people: "fragmentation: asked ...; ... -> action"."""
    return f"{verdict.verdict}: {verdict.reason} -> {verdict.action}"


# The key under which an OOM snapshot's pickle carries its verdict (beside PyTorch's own
# "segments" and "device_traces", which the viewers read; an extra key is ignored there), so
# that a downloaded snapshot keeps its verdict offline (exporter.viewer shows it).
SNAPSHOT_KEY = "gpumem_oom_verdict"


# OOMs less than this apart are one burst (a storm: a server retrying the same request).
BURST_GAP_S = 30.0


def _completeness(verdict: OomVerdict, snapshot_coming: bool) -> int:
    """How much an OOM's record tells: its readings taken, and its snapshot (worth two)."""
    readings = len(verdict.deciding_bytes())
    return readings + (2 if verdict.snapshot or snapshot_coming else 0) - bool(verdict.missing)


class OomLog:
    """This process's OOM verdicts: per device the most complete of the latest burst (with
    how many OOMs followed it) and counts by verdict. Written by the OOM observer (any
    thread), read by the allocator source on every tick."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, OomVerdict] = {}
        self._counts: dict[int, dict[str, int]] = {}
        self._latest_at: dict[int, float] = {}  # the device's latest OOM, kept or not
        self._latest_verdict: dict[int, str] = {}  # and its verdict (what is logged)
        self._snapshot_coming: dict[int, float] = {}  # OOM time whose snapshot is written
        # Called (no argument) when a verdict or its snapshot comes in: `run`'s agent sends
        # its full sample then, not at its next detail interval (the count of the OOM went
        # out with a record while the observer was still taking its readings).
        self.on_change: list[Callable[[], None]] = []

    def record(self, verdict: OomVerdict, *, snapshot_coming: bool = False) -> bool:
        """Count `verdict` and keep it, unless it follows a more complete one of the same
        burst (then that one stays, counting it as followed); `snapshot_coming`: a snapshot
        of this OOM is being written. True when the verdict differs from the device's
        previous one (the observer logs only those: a storm would log hundreds of lines)."""
        device = verdict.device
        with self._lock:
            previous = self._last.get(device)
            said = self._latest_verdict.get(device)
            self._latest_verdict[device] = verdict.verdict
            latest = self._latest_at.get(device)
            in_burst = latest is not None and verdict.timestamp - latest <= BURST_GAP_S
            if (
                previous is not None
                and in_burst
                and _completeness(previous, self._snapshot_coming.get(device) == previous.timestamp)
                > _completeness(verdict, snapshot_coming)
            ):
                self._last[device] = replace(previous, followed=previous.followed + 1)
            else:
                self._last[device] = verdict
                if snapshot_coming:
                    self._snapshot_coming[device] = verdict.timestamp
            self._latest_at[device] = max(verdict.timestamp, latest or 0.0)
            counts = self._counts.setdefault(verdict.device, {})
            counts[verdict.verdict] = counts.get(verdict.verdict, 0) + 1
        self._changed()
        return said != verdict.verdict

    def set_snapshot(self, device: int, timestamp: float, snapshot_id: str) -> None:
        """Link the snapshot written for the OOM at `timestamp` (written after the observer)."""
        with self._lock:
            last = self._last.get(device)
            if last is not None and last.timestamp == timestamp:
                self._last[device] = replace(last, snapshot=snapshot_id)
        self._changed()

    def _changed(self) -> None:
        for call in self.on_change:
            with contextlib.suppress(Exception):  # runs on the OOM-ing thread: never raise
                call()

    def last(self, device: int) -> OomVerdict | None:
        with self._lock:
            return self._last.get(device)

    def counts(self, device: int) -> dict[str, int]:
        with self._lock:
            return dict(self._counts.get(device, {}))

    def annotate(self, readings: Iterable[Any]) -> None:
        """Give each AllocatorReading its device's latest verdict and counts."""
        with self._lock:
            if not self._last:
                return
            for reading in readings:
                reading.last_oom = self._last.get(reading.device)
                reading.ooms_by_verdict = dict(self._counts.get(reading.device, {}))
