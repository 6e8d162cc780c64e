"""The snapshot as typed records: segments, blocks, frames, history entries and their totals.

The snapshot may come from any torch version or from an upload, so its values are read
defensively here once; the renderer works on these records only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from exporter.viewer.load import INT_LIMIT, MAX_TEXT_CHARS, SnapshotError

# The snapshot may come from any torch version (keys appear and disappear) or from an upload,
# so values are read defensively once here and the renderers work on typed records. No value
# from the file is passed to str() unless it is a scalar: str() of a list that holds itself
# through the memo would not end.

ALLOCATED, PENDING, INACTIVE = "active_allocated", "active_pending_free", "inactive"


def as_int(value: Any) -> int:
    if type(value) is int:  # the common case, first: this runs for every block and event
        return value if -INT_LIMIT < value < INT_LIMIT else 0
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value) if -INT_LIMIT < value < INT_LIMIT else 0
    if isinstance(value, float) and math.isfinite(value) and abs(value) < INT_LIMIT:
        return int(value)
    return 0


def as_text(value: Any, default: str = "?") -> str:
    """A scalar as text, cut to MAX_TEXT_CHARS; anything else is `default`."""
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT_CHARS else value[:MAX_TEXT_CHARS] + "…"
    if isinstance(value, bool | float) or (
        isinstance(value, int) and -INT_LIMIT < value < INT_LIMIT
    ):
        return str(value)
    if isinstance(value, bytes):
        return repr(value[:MAX_TEXT_CHARS])
    return default


def as_list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, (list, tuple)) else ()


PageT = TypeVar("PageT", bound=str)


class Budget:
    """The work left for one render: items walked and characters of page written."""

    def __init__(self, max_items: int, max_frames: int, max_page_chars: int) -> None:
        self.max_items, self.items_left = max_items, max_items
        self.max_frames, self.frames_left = max_frames, max_frames
        self.max_page_chars, self.chars_left = max_page_chars, max_page_chars

    def walk(self, n: int) -> None:
        self.items_left -= n
        if self.items_left < 0:
            raise SnapshotError(
                f"too large to render: more than {self.max_items:,} segments, blocks and "
                "history entries (each reference to a shared list counted again)"
            )

    def walk_frames(self, n: int) -> None:
        self.frames_left -= n
        if self.frames_left < 0:
            raise SnapshotError(
                f"too large to render: more than {self.max_frames:,} stack frames of live "
                "blocks (each reference to a shared stack counted again)"
            )

    def page(self, text: PageT) -> PageT:
        self.chars_left -= len(text)
        if self.chars_left < 0:
            raise SnapshotError(
                f"too large to render: the page would pass {self.max_page_chars:,} characters"
            )
        return text


class Frame(NamedTuple):  # a NamedTuple: built for every frame of every block, and hashable
    filename: str
    line: int
    name: str

    def text(self) -> str:
        return f"{self.filename}:{self.line} {self.name}"


def _frames(value: Any, cache: dict[int, Frame]) -> tuple[Frame, ...]:
    # torch shares one dict per distinct frame between all stacks: parse each once.
    frames = []
    for f in as_list(value):
        frame = cache.get(id(f))
        if frame is None:
            if not isinstance(f, dict):
                continue
            frame = Frame(as_text(f.get("filename")), as_int(f.get("line")), as_text(f.get("name")))
            cache[id(f)] = frame
        frames.append(frame)
    return tuple(frames)


@dataclass(slots=True)
class Block:
    address: int
    size: int
    requested_size: int
    state: str
    frames: tuple[Frame, ...]


@dataclass(slots=True)
class Segment:
    device: int
    address: int
    total_size: int
    stream: int
    segment_type: str
    pool: str
    is_expandable: bool
    blocks: list[Block]
    # Used when a snapshot has no block list (very old torch): segment-level sums.
    allocated_size: int = 0
    active_size: int = 0

    @property
    def allocated(self) -> int:
        if not self.blocks:
            return self.allocated_size
        return sum(b.size for b in self.blocks if b.state == ALLOCATED)

    @property
    def active(self) -> int:
        if not self.blocks:
            return self.active_size
        return sum(b.size for b in self.blocks if b.state != INACTIVE)


@dataclass
class TraceEntry:
    action: str
    addr: int
    size: int
    stream: int
    time_us: int
    # The entries' frames are not read: the page does not show them, and parsing them was
    # two thirds of the render time on a 100k-entry history.


def _state(block: Mapping[str, Any]) -> str:
    return as_text(block.get("state", INACTIVE))


def count_work(snapshot: Mapping[str, Any], budget: Budget) -> None:
    """Charge the walk to `budget` before anything is built, so that a snapshot that names one
    big segment ten thousand times is refused at once and in constant memory.

    Lengths first (one step per segment and per device), then the frames of live blocks (the
    only frames that are read), which needs a step per block.
    """
    segments = [s for s in as_list(snapshot.get("segments")) if isinstance(s, dict)]
    budget.walk(len(segments))
    for s in segments:
        budget.walk(len(as_list(s.get("blocks"))))
    for entries in as_list(snapshot.get("device_traces")):
        budget.walk(len(as_list(entries)))
    for s in segments:
        for b in as_list(s.get("blocks")):
            if isinstance(b, dict) and _state(b) != INACTIVE:
                budget.walk_frames(len(as_list(b.get("frames"))))


def segments_of(snapshot: Mapping[str, Any]) -> list[Segment]:
    segments = []
    frame_cache: dict[int, Frame] = {}
    for s in as_list(snapshot.get("segments")):
        if not isinstance(s, dict):
            continue
        blocks = []
        for b in as_list(s.get("blocks")):
            if not isinstance(b, dict):
                continue
            state = _state(b)
            # A free block's frames (if any) are its last user's: not shown, so not parsed.
            frames = _frames(b.get("frames"), frame_cache) if state != INACTIVE else ()
            blocks.append(
                Block(
                    as_int(b.get("address")),
                    as_int(b.get("size")),
                    as_int(b.get("requested_size")),
                    state,
                    frames,
                )
            )
        pool = s.get("segment_pool_id", (0, 0))
        pool_text = (
            ",".join(as_text(p) for p in pool[:4])
            if isinstance(pool, list | tuple)
            else as_text(pool)
        )
        segments.append(
            Segment(
                device=as_int(s.get("device")),
                address=as_int(s.get("address")),
                total_size=as_int(s.get("total_size")),
                stream=as_int(s.get("stream")),
                segment_type=as_text(s.get("segment_type")),
                pool=pool_text,
                is_expandable=s.get("is_expandable") is True,
                blocks=blocks,
                allocated_size=as_int(s.get("allocated_size")),
                active_size=as_int(s.get("active_size")),
            )
        )
    return segments


def traces_of(snapshot: Mapping[str, Any]) -> dict[int, list[TraceEntry]]:
    """device -> entries in time order; device_traces holds one list per device index."""
    traces: dict[int, list[TraceEntry]] = {}
    for device, entries in enumerate(as_list(snapshot.get("device_traces"))):
        parsed = [
            TraceEntry(
                as_text(e.get("action")),
                as_int(e.get("addr")),
                as_int(e.get("size")),
                as_int(e.get("stream")),
                as_int(e.get("time_us")),
            )
            for e in as_list(entries)
            if isinstance(e, dict)
        ]
        if parsed:
            parsed.sort(key=lambda e: e.time_us)  # already in order; cheap insurance
            traces[device] = parsed
    return traces


@dataclass
class Totals:
    reserved: int = 0
    allocated: int = 0
    pending: int = 0
    inactive: int = 0
    requested: int = 0
    fragmented: int = 0  # inactive bytes in segments that hold an active block
    releasable: int = 0  # segments with nothing active: empty_cache frees them
    largest_free: int = 0
    segments: int = 0
    blocks: int = 0
    expandable: int = 0
    pools: set[str] = field(default_factory=set)

    @property
    def active(self) -> int:
        return self.allocated + self.pending

    def add(self, seg: Segment) -> None:
        self.reserved += seg.total_size
        self.segments += 1
        self.blocks += len(seg.blocks)
        self.expandable += seg.is_expandable
        self.pools.add(seg.pool)
        active = seg.active
        if seg.blocks:
            self.allocated += sum(b.size for b in seg.blocks if b.state == ALLOCATED)
            self.pending += sum(b.size for b in seg.blocks if b.state == PENDING)
            self.requested += sum(b.requested_size for b in seg.blocks if b.state != INACTIVE)
            free = [b.size for b in seg.blocks if b.state == INACTIVE]
            inactive = sum(free)
            self.largest_free = max([self.largest_free, *free])
        else:
            self.allocated += seg.allocated_size
            self.pending += max(0, seg.active_size - seg.allocated_size)
            inactive = max(0, seg.total_size - seg.active_size)
        self.inactive += inactive
        if active:
            self.fragmented += inactive
        else:
            self.releasable += seg.total_size


def totals_of(segments: Iterable[Segment]) -> Totals:
    t = Totals()
    for s in segments:
        t.add(s)
    return t


_RESERVED_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass
class Replay:
    times_s: list[float]  # seconds since the first entry (entry numbers when untimed)
    allocated: list[int]
    reserved: list[int]
    anchored: bool  # False when the history does not match the segments (values shifted)
    timed: bool = True


def replay_of(entries: Sequence[TraceEntry], end_allocated: int, end_reserved: int) -> Replay:
    """Allocated and reserved bytes after each entry.

    The history is a ring buffer (max_entries): when it wrapped, the state at its first entry
    is unknown. The state at its last entry is the snapshot itself, taken at the same moment,
    so the replay runs forward on deltas and is then anchored at the end. A block counts as
    allocated from `alloc` until `free_completed`, as in the snapshot's active blocks.
    """
    t0 = entries[0].time_us
    # Entries without time_us (older torch) are spread evenly, by entry number.
    timed = len(entries) < 2 or entries[-1].time_us > t0
    times, alloc_d, res_d = [], [], []
    a = r = 0
    for i, e in enumerate(entries):
        if e.action == "alloc":
            a += e.size
        elif e.action == "free_completed":
            a -= e.size
        r += _RESERVED_DELTA.get(e.action, 0) * e.size
        times.append((e.time_us - t0) / 1e6 if timed else float(i))
        alloc_d.append(a)
        res_d.append(r)
    alloc = [end_allocated - a + x for x in alloc_d]
    res = [end_reserved - r + x for x in res_d]
    a_min, r_min = min(alloc), min(res)  # once: inside the comprehensions it was quadratic
    anchored = a_min >= 0 and r_min >= 0
    # When the history and the segments disagree (an edited or partial file), show the shape
    # of the changes, shifted up so that nothing is negative.
    if a_min < 0:
        alloc = [x - a_min for x in alloc]
    if r_min < 0:
        res = [x - r_min for x in res]
    return Replay(times, alloc, res, anchored, timed)
