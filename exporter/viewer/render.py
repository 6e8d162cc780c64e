"""The page: one self-contained HTML document for a snapshot, with no script and nothing
loaded from anywhere (a Content-Security-Policy meta tag blocks any load that slips in).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import Any

from exporter.oom_verdict import SNAPSHOT_KEY
from exporter.units import fmt_bytes as _fmt_bytes
from exporter.viewer.load import (
    MAX_DEVICES,
    MAX_PAGE_CHARS,
    MAX_RENDER_FRAMES,
    MAX_RENDER_ITEMS,
    NO_HISTORY_MESSAGE,
    SnapshotError,
)
from exporter.viewer.markup import Html, escape, html, join
from exporter.viewer.model import (
    ALLOCATED,
    INACTIVE,
    PENDING,
    Block,
    Budget,
    Frame,
    Replay,
    Segment,
    Totals,
    TraceEntry,
    as_list,
    as_text,
    count_work,
    replay_of,
    segments_of,
    totals_of,
    traces_of,
)

# -- formatting ------------------------------------------------------------------------------


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def _hex(addr: int) -> str:
    return f"0x{addr:x}"


# Frames in torch's own code (and C++ frames with stacks="all") say little about who
# allocated: the summary line of a stack shows the innermost frame outside them.
_LIBRARY_MARKERS = ("/torch/", "/site-packages/", "/dist-packages/", "<frozen ")


def _user_frame(frames: Sequence[Frame]) -> Frame | None:
    python = [f for f in frames if f.filename.endswith(".py")]
    for f in python:
        if not any(m in f.filename for m in _LIBRARY_MARKERS):
            return f
    if python:
        return python[0]
    return frames[0] if frames else None


MAX_FRAMES_SHOWN = 40


def _stack_html(frames: Sequence[Frame]) -> Html:
    """A collapsible stack, innermost frame first (the order torch records them in)."""
    if not frames:
        return Html('<span class="muted">no stack recorded</span>')
    top = _user_frame(frames)
    shown = frames[:MAX_FRAMES_SHOWN]
    lines = join(html("<li>{frame}</li>", frame=f.text()) for f in shown)
    if len(frames) > len(shown):
        more = len(frames) - len(shown)
        lines += html('<li class="muted">… {more} more frames</li>', more=more)
    return html(
        "<details><summary><code>{summary}</code> "
        '<span class="muted">({count} frames)</span></summary>'
        '<ol class="stack">{lines}</ol></details>',
        summary=top.text() if top else "",
        count=len(frames),
        lines=lines,
    )


def _table(header: Sequence[str], rows: Iterable[Sequence[object]], cls: str = "") -> Html:
    """Cells are escaped unless they are Html."""
    head = join(html("<th>{h}</th>", h=h) for h in header)
    body = join(
        html("<tr>{cells}</tr>", cells=join(html("<td>{c}</td>", c=c) for c in row)) for row in rows
    )
    return html(
        '<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>',
        cls=cls,
        head=head,
        body=body,
    )


# -- summary ---------------------------------------------------------------------------------


def _summary_html(
    segments: list[Segment],
    by_device: dict[int, list[Segment]],
    traces: dict[int, list[TraceEntry]],
    snapshot: Mapping[str, Any],
) -> Html:
    devices = sorted(by_device.keys() | traces.keys())
    total = totals_of(segments)
    return join(
        (
            _summary_cards(total, traces),
            _device_table(devices, by_device, traces),
            _summary_notes(total, devices, snapshot),
        )
    )


def _summary_cards(total: Totals, traces: dict[int, list[TraceEntry]]) -> Html:
    """The headline numbers of the whole snapshot, one card each."""
    ooms = sum(1 for entries in traces.values() for e in entries if e.action == "oom")
    cards = [
        ("Reserved", _fmt_bytes(total.reserved), f"{total.segments} segments", ""),
        (
            "Allocated",
            _fmt_bytes(total.allocated),
            f"{_pct(total.allocated, total.reserved)} of reserved, {total.blocks} blocks",
            "",
        ),
        (
            "Free in cache",
            _fmt_bytes(total.inactive),
            f"{_fmt_bytes(total.releasable)} in fully free segments",
            "",
        ),
        (
            "Fragmentation",
            _pct(total.fragmented, total.reserved),
            f"{_fmt_bytes(total.fragmented)} free inside used segments",
            "warn" if total.reserved and total.fragmented / total.reserved > 0.2 else "",
        ),
        (
            "Largest free block",
            _fmt_bytes(total.largest_free),
            "biggest allocation that fits without a new segment",
            "",
        ),
        (
            "OOMs recorded",
            str(ooms) if traces else "n/a",
            # Without history a snapshot cannot tell: 0 would claim that none happened.
            "in the recorded history" if traces else "no history recorded: unknown",
            "bad" if ooms else "",
        ),
    ]
    cards_html = join(
        html(
            '<div class="card {cls}"><div class="label">{label}</div>'
            '<div class="value">{value}</div><div class="sub">{sub}</div></div>',
            cls=cls,
            label=label,
            value=value,
            sub=sub,
        )
        for label, value, sub, cls in cards
    )
    return html('<div class="cards">{cards}</div>', cards=cards_html)


def _device_table(
    devices: list[int], by_device: dict[int, list[Segment]], traces: dict[int, list[TraceEntry]]
) -> Html:
    """One row per device: its totals and counts."""
    rows = []
    for d in devices:
        t = totals_of(by_device.get(d, ()))
        rows.append(
            [
                f"cuda:{d}",
                _fmt_bytes(t.reserved),
                _fmt_bytes(t.allocated),
                _fmt_bytes(t.pending),
                _fmt_bytes(t.active),
                _fmt_bytes(t.inactive),
                _fmt_bytes(t.requested),
                _pct(t.fragmented, t.reserved),
                _fmt_bytes(t.releasable),
                _fmt_bytes(t.largest_free),
                t.segments,
                t.blocks,
                len(t.pools),
                len(traces.get(d, [])),
            ]
        )
    header = [
        "device",
        "reserved",
        "allocated",
        "pending free",
        "active",
        "inactive (free)",
        "requested",
        "fragmentation",
        "in free segments",
        "largest free block",
        "segments",
        "blocks",
        "pools",
        "history entries",
    ]
    return _table(header, rows, "num")


def _summary_notes(total: Totals, devices: list[int], snapshot: Mapping[str, Any]) -> Html:
    """What the numbers mean, and what the page leaves out."""
    notes = [
        Html(
            "Active = allocated + pending free (freed by the program, waiting on a stream "
            "event). Fragmentation = free bytes in segments that still hold an active block, "
            "over reserved: that memory can only be reused by allocations that fit into the "
            "holes, and <code>empty_cache()</code> cannot release it. Bytes in fully free "
            "segments can be released by <code>empty_cache()</code>."
        )
    ]
    if total.expandable:
        notes.append(
            html(
                "{n} expandable segment(s): sizes are mapped memory and the largest free block "
                "understates what fits, because the segment can grow.",
                n=total.expandable,
            )
        )
    n_traces = len(as_list(snapshot.get("device_traces")))
    if n_traces > len(devices):
        notes.append(
            html(
                "The process had {n} CUDA devices; devices without segments or history are not "
                "shown.",
                n=n_traces,
            )
        )
    return join(html('<p class="note">{note}</p>', note=note) for note in notes)


MAX_SETTINGS = 100


def _settings_html(settings: Any) -> Html:
    if not isinstance(settings, Mapping) or not settings:
        return Html('<p class="muted">No allocator settings in this snapshot (older torch).</p>')
    rows = []
    # torch has about ten settings; a file with thousands is not one of its snapshots.
    for key in sorted(settings, key=as_text)[:MAX_SETTINGS]:
        value = settings[key]
        if isinstance(value, Mapping):
            # roundup_power2_divisions: 16 buckets, almost always all zero.
            nonzero = [
                f"{as_text(k)}={as_text(v)}" for k, v in islice(value.items(), MAX_SETTINGS) if v
            ]
            text = ", ".join(nonzero) if nonzero else f"all {len(value)} entries 0"
        elif value == "" or value is None:
            text = "(unset)"
        elif key == "max_split_size" and value == -1:
            text = "-1 (no limit: any free block may be split)"
        else:
            text = as_text(value)
        rows.append([html("<code>{key}</code>", key=as_text(key)), text])
    return _table(["setting", "value"], rows, "kv")


def _meta_value(value: Any) -> str:
    """A header value as a person reads it: a process as `pid 42 rank 0`, never a dict."""
    if value is True or value is False:
        return "yes" if value else "no"
    if isinstance(value, Mapping):
        return " ".join(f"{k} {_meta_value(v)}" for k, v in value.items() if v not in ("", None))
    return str(value)


# Header values that are times (Unix seconds) or byte counts: shown as a person reads them.
_META_TIMES = frozenset({"created"})
_META_BYTES = frozenset({"alloc_size", "device_free", "size_bytes"})


def _utc(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp))


def _meta_html(meta: Mapping[str, Any] | None) -> Html:
    if not meta:
        return Html("")

    def shown(key: str, value: Any) -> str:
        if key in _META_TIMES and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _utc(value)
        if key in _META_BYTES and isinstance(value, int) and not isinstance(value, bool):
            return _fmt_bytes(value)
        return _meta_value(value)

    items = join(
        html("<span><b>{key}</b> {value}</span>", key=k, value=shown(k, v))
        for k, v in meta.items()
        if k != "oom"  # the verdict card shows it
    )
    return html('<div class="meta">{items}</div>', items=items)


# The verdict card: the deciding readings in the order an on-call compares them.
_VERDICT_NUMBERS = (
    ("requested_bytes", "asked"),
    ("free_in_holes_bytes", "free in the cache"),
    ("largest_free_block_bytes", "largest free block"),
    ("cap_room_bytes", "room under the cap"),
    ("device_free_bytes", "GPU free"),
    ("other_processes_bytes", "other processes"),
)


def _verdict_html(verdict: Any) -> Html:
    """The OOM this snapshot was taken at: its verdict, the numbers that decided it, what to
    do. Empty for a snapshot taken otherwise (or a verdict of another shape)."""
    if not isinstance(verdict, Mapping) or not isinstance(verdict.get("verdict"), str):
        return Html("")
    numbers = join(
        html("<span>{label} <b>{value}</b></span>", label=label, value=_fmt_bytes(value))
        for key, label in _VERDICT_NUMBERS
        if isinstance(value := verdict.get(key), int) and not isinstance(value, bool)
    )
    at = verdict.get("timestamp")
    when = _utc(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else "?"
    return html(
        '<div class="verdict"><h2>Out of memory: {verdict}</h2>'
        '<div class="where">cuda:{device} at {when}</div>'
        '<div class="numbers">{numbers}</div><p>{reason}</p><p><b>Do:</b> {action}</p>'
        "{missing}</div>",
        verdict=verdict["verdict"],
        device=_meta_value(verdict.get("device", "?")),
        when=when,
        numbers=numbers,
        reason=str(verdict.get("reason", "")),
        action=str(verdict.get("action", "")),
        missing=(
            html('<p class="missing">Not read: {m}</p>', m=str(verdict["missing"]))
            if verdict.get("missing")
            else Html("")
        ),
    )


# -- segment map -----------------------------------------------------------------------------

MAP_WIDTH_PX = 1240  # fixed, so that bar widths can be worked out here
MAP_TARGET_ROWS = 24  # the whole reserved memory of a device fills about this many rows
MIN_SEGMENT_PX = 6
MIN_BLOCK_PX = 2.0

_STATE_CLASS = {ALLOCATED: "a", PENDING: "p"}


def _block_title(b: Block, seg: Segment) -> str:
    state = {ALLOCATED: "allocated", PENDING: "pending free"}.get(b.state, "free")
    text = f"{state} {_fmt_bytes(b.size)} at {_hex(b.address)}"
    if b.state != INACTIVE:
        text += f" (requested {_fmt_bytes(b.requested_size)})"
        top = _user_frame(b.frames)
        text += f"\n{top.text()}" if top else "\nno stack recorded"
    return text


def _piece(cls: str, share: float, title: str) -> Html:
    return html(
        '<i class="{cls}" style="width:{share:.3f}%" title="{title}"></i>',
        cls=cls,
        share=share,
        title=title,
    )


def _segment_html(seg: Segment, width: float) -> Html:
    """One segment: a bar of fixed pixel width, blocks as percentages of it.

    Runs of blocks too narrow to see are merged into one piece coloured by the state that
    holds most of their bytes, so that a segment never draws more pieces than it has pixels.
    """
    active = seg.active
    free_cls = "f" if active else "r"  # free in a used segment vs. a releasable segment
    title = (
        f"segment {_hex(seg.address)}: {_fmt_bytes(seg.total_size)} {seg.segment_type} pool, "
        f"pool id {seg.pool}, stream {seg.stream}{', expandable' if seg.is_expandable else ''}\n"
        f"allocated {_fmt_bytes(seg.allocated)}, active {_fmt_bytes(active)}, "
        f"free {_fmt_bytes(seg.total_size - active)}, {len(seg.blocks)} blocks"
    )
    total = seg.total_size or 1
    pieces: list[Html] = []
    run: list[Block] = []
    run_size = 0

    def flush_run() -> None:
        nonlocal run_size
        if not run:
            return
        size, run_size = run_size, 0
        by_state: Counter[str] = Counter()
        for b in run:
            by_state[b.state] += b.size
        state = by_state.most_common(1)[0][0]
        detail = ", ".join(
            f"{s.replace('active_', '')} {_fmt_bytes(n)}" for s, n in by_state.items()
        )
        t = f"{len(run)} small blocks ({_fmt_bytes(size)}): {detail}"
        pieces.append(_piece(_STATE_CLASS.get(state, free_cls), 100 * size / total, t))
        run.clear()

    blocks = seg.blocks or [
        # No block list: draw the segment-level split.
        Block(seg.address, seg.allocated_size, seg.allocated_size, ALLOCATED, ()),
        Block(0, max(0, seg.active_size - seg.allocated_size), 0, PENDING, ()),
        Block(0, max(0, seg.total_size - seg.active_size), 0, INACTIVE, ()),
    ]
    for b in blocks:
        if b.size <= 0:
            continue
        if width * b.size / total < MIN_BLOCK_PX:
            run.append(b)
            run_size += b.size
            if run_size * width / total >= MIN_BLOCK_PX:
                flush_run()
            continue
        flush_run()
        cls = _STATE_CLASS.get(b.state, free_cls)
        pieces.append(_piece(cls, 100 * b.size / total, _block_title(b, seg)))
    flush_run()
    return html(
        '<div class="seg{x}" style="width:{width:.0f}px" title="{title}">{pieces}</div>',
        x=" x" if seg.is_expandable else "",
        width=width,
        title=title,
        pieces=join(pieces),
    )


def _pool_label(pool: str, names: Mapping[str, str]) -> str:
    if pool == "0,0":
        return "default pool"
    name = names.get(pool)
    return f"private pool {name}" if name else "private pool (CUDA graphs / mempool)"


def _segment_map_html(
    segments: list[Segment], max_segments: int, budget: Budget, names: Mapping[str, str]
) -> Html:
    """The map of one device's segments."""
    segs = [s for s in segments if s.total_size > 0]
    if not segs:
        return Html('<p class="muted">No segments on this device.</p>')
    left_out: list[Segment] = []
    max_segments = max(1, max_segments)
    if len(segs) > max_segments:
        # Keep the biggest; the rest are summarised, so thousands of 2 MiB segments from
        # the small pool cannot make the page unusable.
        segs.sort(key=lambda s: s.total_size, reverse=True)
        segs, left_out = segs[:max_segments], segs[max_segments:]
    reserved = sum(s.total_size for s in segs)
    px_per_byte = MAP_WIDTH_PX * MAP_TARGET_ROWS / reserved
    smallest_true = math.ceil(MIN_SEGMENT_PX / px_per_byte)

    pools: dict[str, list[Segment]] = {}
    for s in segs:
        pools.setdefault(s.pool, []).append(s)
    parts = []
    for pool in sorted(pools, key=lambda p: (p != "0,0", p)):
        members = sorted(pools[pool], key=lambda s: s.address)
        t = totals_of(members)
        bars = join(
            budget.page(
                _segment_html(s, min(MAP_WIDTH_PX, max(MIN_SEGMENT_PX, s.total_size * px_per_byte)))
            )
            for s in members
        )
        parts.append(
            html(
                "<h4>{label} <code>({pool})</code>: {segments} segments, {reserved} reserved, "
                "{allocated} allocated, fragmentation {fragmentation}</h4>"
                '<div class="map" style="width:{width}px">{bars}</div>',
                label=_pool_label(pool, names),
                pool=pool,
                segments=t.segments,
                reserved=_fmt_bytes(t.reserved),
                allocated=_fmt_bytes(t.allocated),
                fragmentation=_pct(t.fragmented, t.reserved),
                width=MAP_WIDTH_PX,
                bars=bars,
            )
        )
    scale = html(
        "Width is proportional to size ({per_pixel} per pixel); segments smaller than "
        "{smallest} are drawn {min_px} px wide. Segments are in address order within each "
        "pool; hover for sizes, addresses and the allocating frame.",
        per_pixel=_fmt_bytes(1 / px_per_byte),
        smallest=_fmt_bytes(smallest_true),
        min_px=MIN_SEGMENT_PX,
    )
    if left_out:
        scale += html(
            " <b>{n} smaller segments ({size}) are not drawn</b>: only the {kept} largest are.",
            n=len(left_out),
            size=_fmt_bytes(sum(s.total_size for s in left_out)),
            kept=max_segments,
        )
    return html('<p class="note">{scale}</p>{parts}', scale=scale, parts=join(parts))


_LEGEND = Html(
    '<div class="legend">'
    '<span><i class="a"></i>allocated</span>'
    '<span><i class="p"></i>pending free (freed, waiting on a stream)</span>'
    '<span><i class="f"></i>free inside a used segment (fragmentation)</span>'
    '<span><i class="r"></i>free segment (empty_cache releases it)</span>'
    "</div>"
)


# -- biggest allocations and allocation sites ------------------------------------------------


def _top_blocks_html(segments: list[Segment], top_n: int) -> Html:
    live = [(b, s) for s in segments for b in s.blocks if b.state != INACTIVE]
    if not live:
        return Html('<p class="muted">No live allocations.</p>')
    live.sort(key=lambda bs: bs[0].size, reverse=True)
    rows = []
    for i, (b, s) in enumerate(live[:top_n], 1):
        rows.append(
            [
                i,
                html("<b>{size}</b>", size=_fmt_bytes(b.size)),
                _fmt_bytes(b.requested_size),
                html("<code>{address}</code>", address=_hex(b.address)),
                "allocated" if b.state == ALLOCATED else "pending free",
                html(
                    "<code>{address}</code> {size} {kind}",
                    address=_hex(s.address),
                    size=_fmt_bytes(s.total_size),
                    kind=s.segment_type,
                ),
                f"cuda:{s.device} / {s.stream}",
                _stack_html(b.frames),
            ]
        )
    note = html(
        '<p class="note">{shown} of {live} live blocks ({size}). Stacks are innermost frame '
        "first; the summary line is the innermost frame outside torch and site-packages. "
        "Blocks allocated before history recording started have no stack.</p>",
        shown=min(top_n, len(live)),
        live=len(live),
        size=_fmt_bytes(sum(b.size for b, _ in live)),
    )
    header = ["#", "size", "requested", "address", "state", "segment", "device / stream", "stack"]
    return note + _table(header, rows, "top")


def _sites_html(segments: list[Segment], top_n: int = 15) -> Html:
    """Live bytes grouped by allocating stack: where a leak or a big cache lives."""
    sites: dict[tuple[Frame, ...], list[int]] = {}
    for s in segments:
        for b in s.blocks:
            if b.state != INACTIVE:
                entry = sites.setdefault(b.frames, [0, 0])
                entry[0] += b.size
                entry[1] += 1
    if not sites:
        return Html('<p class="muted">No live allocations.</p>')
    total = sum(v[0] for v in sites.values())
    ranked = sorted(sites.items(), key=lambda kv: kv[1][0], reverse=True)
    rows = [
        [
            html("<b>{size}</b>", size=_fmt_bytes(size)),
            _pct(size, total),
            count,
            _stack_html(frames),
        ]
        for frames, (size, count) in ranked[:top_n]
    ]
    note = html(
        '<p class="note">{n} distinct stacks; the top {top} by live bytes.</p>',
        n=len(sites),
        top=len(rows),
    )
    return note + _table(["live bytes", "share", "blocks", "stack"], rows, "top")


# -- timeline --------------------------------------------------------------------------------

CHART_W, CHART_H = 1240, 320
# "OOM" in the chart's bold 11 px (svg .oom text), with room to spare.
OOM_LABEL_PX = 30
PAD_L, PAD_R, PAD_T, PAD_B = 78, 16, 22, 46

_MARKERS = {
    "segment_alloc": ("#1a9850", "segment allocated (cudaMalloc)"),
    "segment_free": ("#7f7f7f", "segment freed (cudaFree)"),
    "segment_map": ("#66bd63", "pages mapped (expandable segment)"),
    "segment_unmap": ("#a6a6a6", "pages unmapped (expandable segment)"),
    "snapshot": ("#8e44ad", "snapshot taken"),
}


def _nice_step(span: float, target_ticks: int) -> float:
    raw = span / max(1, target_ticks)
    if raw <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _envelope(xs: Sequence[float], ys: Sequence[int], x_of: Any, y_of: Any) -> str:
    """Polyline points keeping the min and max of each pixel column, so spikes survive."""
    columns: dict[int, tuple[int, int, int, int]] = {}  # column -> (lo, lo_at, hi, hi_at)
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        c = round(x_of(x))
        lo, lo_at, hi, hi_at = columns.get(c, (y, i, y, i))
        if y < lo:
            lo, lo_at = y, i
        if y > hi:
            hi, hi_at = y, i
        columns[c] = (lo, lo_at, hi, hi_at)
    points = []
    for c, (lo, lo_at, hi, hi_at) in columns.items():  # insertion order = time order
        for v in (lo, hi) if lo_at <= hi_at else (hi, lo):
            points.append(f"{c},{y_of(v):.1f}")
    return " ".join(points)


def _timeline_svg(entries: Sequence[TraceEntry], replay: Replay) -> Html:
    duration = replay.times_s[-1] if replay.times_s else 0.0
    span_t = duration or 1.0
    y_max = max(max(replay.reserved), max(replay.allocated), 1)
    unit, div = next(
        (u, d)
        for u, d in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
        if y_max >= d or d == 1
    )
    y_step = _nice_step(y_max / div, 5) * div
    y_top = math.ceil(y_max / y_step) * y_step
    plot_w, plot_h = CHART_W - PAD_L - PAD_R, CHART_H - PAD_T - PAD_B

    def x_of(t: float) -> float:
        return PAD_L + plot_w * t / span_t

    def y_of(v: float) -> float:
        return PAD_T + plot_h * (1 - v / y_top)

    out = [
        html(
            '<svg class="chart" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img">',
            w=CHART_W,
            h=CHART_H,
        )
    ]
    # Grid and axes.
    v = 0.0
    while v <= y_top + y_step / 2:
        y = y_of(v)
        out.append(
            html(
                '<line class="grid" x1="{x1}" x2="{x2}" y1="{y:.1f}" y2="{y:.1f}"/>'
                '<text class="tick" x="{tx}" y="{ty:.1f}" text-anchor="end">{label}</text>',
                x1=PAD_L,
                x2=CHART_W - PAD_R,
                y=y,
                tx=PAD_L - 6,
                ty=y + 4,
                label=f"{v / div:g} {unit}",
            )
        )
        v += y_step
    t_step = _nice_step(span_t, 10)
    t = 0.0
    while t <= span_t + t_step / 1000:
        x = x_of(t)
        out.append(
            html(
                '<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{y1}" y2="{y2}"/>'
                '<text class="tick" x="{x:.1f}" y="{ty}" text-anchor="middle">{t:g}{unit}</text>',
                x=x,
                y1=PAD_T,
                y2=PAD_T + plot_h,
                ty=PAD_T + plot_h + 16,
                t=t,
                unit=" s" if replay.timed else "",
            )
        )
        t += t_step
    out.append(
        html(
            '<text class="axis" x="{x}" y="{y}" text-anchor="middle">{axis}</text>',
            x=PAD_L + plot_w / 2,
            y=CHART_H - 6,
            axis="seconds since the first recorded event" if replay.timed else "entry number",
        )
    )
    # Series: reserved first (behind), allocated on top; the area under allocated is shaded.
    res_pts = _envelope(replay.times_s, replay.reserved, x_of, y_of)
    alloc_pts = _envelope(replay.times_s, replay.allocated, x_of, y_of)
    if alloc_pts:
        out.append(
            html(
                '<polygon class="area" points="{first},{floor} {points} {last},{floor}"/>',
                first=alloc_pts.split(" ", 1)[0].split(",")[0],
                last=alloc_pts.rsplit(" ", 1)[-1].split(",")[0],
                floor=PAD_T + plot_h,
                points=alloc_pts,
            )
        )
    out.append(html('<polyline class="reserved" points="{points}"/>', points=res_pts))
    out.append(html('<polyline class="allocated" points="{points}"/>', points=alloc_pts))

    out.extend(_timeline_markers(entries, replay, x_of, plot_h))
    out.append(
        html(
            '<rect class="frame" x="{x}" y="{y}" width="{w}" height="{h}"/></svg>',
            x=PAD_L,
            y=PAD_T,
            w=plot_w,
            h=plot_h,
        )
    )
    return join(out)


def _timeline_markers(
    entries: Sequence[TraceEntry],
    replay: Replay,
    x_of: Callable[[float], float],
    plot_h: float,
) -> list[Html]:
    """Event markers: one per pixel column and kind, with a count, so that thousands of
    segment events do not make thousands of elements."""
    out: list[Html] = []
    buckets: dict[tuple[str, int], list[tuple[float, TraceEntry]]] = {}
    for e, ts in zip(entries, replay.times_s, strict=True):
        if e.action in _MARKERS or e.action == "oom":
            buckets.setdefault((e.action, round(x_of(ts) / 3)), []).append((ts, e))
    unit_t = "s" if replay.timed else "(entry number)"
    for (action, _), marks in sorted(buckets.items(), key=lambda kv: kv[0][0] == "oom"):
        ts = marks[0][0]
        group = [e for _, e in marks]
        x = x_of(ts)
        n = len(group)
        size = sum(g.size for g in group)
        if action == "oom":
            tip = (
                f"OOM at {ts:g} {unit_t}: tried to allocate {_fmt_bytes(group[0].size)} "
                f"with {_fmt_bytes(group[0].addr)} free on the device"
                + (f" (+{n - 1} more OOMs here)" if n > 1 else "")
            )
            # Right of its line, or left of it where the chart ends there: an OOM at the
            # snapshot's last moment (the one it was taken at) was cut to "OC".
            fits = x + 3 + OOM_LABEL_PX <= CHART_W
            out.append(
                html(
                    '<g class="oom"><title>{tip}</title>'
                    '<line x1="{x:.1f}" x2="{x:.1f}" y1="{y1}" y2="{y2}"/>'
                    '<text x="{tx:.1f}" y="{ty}" text-anchor="{anchor}">OOM</text></g>',
                    tip=tip,
                    x=x,
                    y1=PAD_T,
                    y2=PAD_T + plot_h,
                    tx=x + 3 if fits else x - 3,
                    ty=PAD_T + 12,
                    anchor="start" if fits else "end",
                )
            )
            continue
        color, label = _MARKERS[action]
        tip = f"{label} at {ts:g} {unit_t}: {_fmt_bytes(size)}" + (
            f" ({n} events)" if n > 1 else ""
        )
        # Up-triangles for memory gained, down-triangles for memory given back.
        base, apex = PAD_T + plot_h, PAD_T + plot_h - 9
        if action not in ("segment_alloc", "segment_map"):
            base, apex = apex, base
        out.append(
            html(
                '<polygon class="marker" fill="{color}" points="{shape}">'
                "<title>{tip}</title></polygon>",
                color=color,
                shape=f"{x - 5:.1f},{base} {x + 5:.1f},{base} {x:.1f},{apex}",
                tip=tip,
            )
        )
    return out


MAX_ACTIONS_SHOWN = 20

_TIMELINE_LEGEND = Html(
    '<div class="legend">'
    '<span><i class="la"></i>allocated (alloc → free_completed)</span>'
    '<span><i class="lr"></i>reserved (segments)</span>'
    '<span><i class="lo"></i>OOM</span>'
    '<span><i class="ls"></i>segment alloc / map ▲</span>'
    '<span><i class="lf"></i>segment free / unmap ▼</span>'
    "</div>"
)


def _timeline_html(
    device: int, entries: Sequence[TraceEntry], end_allocated: int, end_reserved: int
) -> Html:
    replay = replay_of(entries, end_allocated, end_reserved)
    duration = replay.times_s[-1]
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for e in entries:
        counts[e.action] += 1
        sizes[e.action] += e.size
    start = entries[0].time_us / 1e6
    # time_us is wall-clock microseconds on the torch versions we know; print the start only
    # when it looks like one.
    started = f", starting {_utc(start)}" if 1e9 < start < 1e10 else ""
    a_lo, a_hi = min(replay.allocated), max(replay.allocated)
    facts = escape(
        f"{len(entries)} entries "
        + (f"over {duration:.3f} s{started}" if replay.timed else "without times")
        + ". Allocated in the "
        f"window: min {_fmt_bytes(a_lo)}, max {_fmt_bytes(a_hi)}, at the end "
        f"{_fmt_bytes(replay.allocated[-1])}; reserved at the end "
        f"{_fmt_bytes(replay.reserved[-1])}."
    )
    if not replay.anchored:
        facts += Html(
            " <b>The history does not add up to the segments in this snapshot; the lines show "
            "changes, shifted so that their minimum is 0.</b>"
        )
    count_rows: list[list[object]] = [
        [html("<code>{action}</code>", action=action), n, _fmt_bytes(sizes[action])]
        for action, n in counts.most_common(MAX_ACTIONS_SHOWN)
    ]
    if len(counts) > MAX_ACTIONS_SHOWN:  # torch has 9 actions; an edited file may have more
        rest = len(counts) - MAX_ACTIONS_SHOWN
        count_rows.append([html('<span class="muted">{n} more actions</span>', n=rest), "", ""])
    return html(
        '<h3>cuda:{device}</h3><p class="note">{facts} The history keeps the last '
        "<code>max_entries</code> events, so a busy process covers a short window.</p>"
        '{legend}{chart}<div class="side">{table}</div>',
        device=device,
        facts=facts,
        legend=_TIMELINE_LEGEND,
        chart=_timeline_svg(entries, replay),
        table=_table(["action", "count", "bytes"], count_rows, "num small"),
    )


# -- page ------------------------------------------------------------------------------------

_CSS = Html(
    """
:root{--a:#2f6fdf;--p:#f0a020;--f:#f3a5a5;--r:#d5dae1;--fg:#1d2733;--muted:#667385;
--line:#d9dee5;--bg:#f6f7f9}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
color:var(--fg);background:var(--bg)}
main{max-width:1300px;margin:0 auto;padding:18px 24px 60px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:30px 0 8px;padding-bottom:4px;border-bottom:2px solid var(--line)}
h3{font-size:15px;margin:14px 0 4px}
h4{font-size:13px;font-weight:600;margin:14px 0 6px}
code{font:12px/1.35 ui-monospace,"SFMono-Regular",Menlo,"DejaVu Sans Mono",monospace}
nav a{margin-right:14px;color:var(--a);text-decoration:none}
.meta{display:flex;flex-wrap:wrap;gap:6px 18px;margin:6px 0 10px;color:var(--muted)}
.meta b{color:var(--fg);font-weight:600}
.banner{background:#fff4d6;border:1px solid #e7c66b;padding:6px 10px;border-radius:4px;
margin:8px 0}
.verdict{background:#fde8e8;border-left:4px solid #b42318;padding:8px 12px;margin:8px 0;
border-radius:4px}
.verdict h2{margin:0 0 4px;border:0;padding:0}
.verdict .numbers{display:flex;flex-wrap:wrap;gap:4px 16px}
.verdict p{margin:4px 0}
.cards{display:grid;grid-template-columns:repeat(6,1fr);gap:10px;margin:10px 0 14px}
.card{background:#fff;border:1px solid var(--line);border-radius:6px;padding:10px 12px}
.card .label{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .value{font-size:22px;font-weight:650;margin:2px 0}
.card .sub{color:var(--muted);font-size:12px}
.card.warn{border-color:#e7a33a;background:#fff8ec}
.card.bad{border-color:#d64545;background:#fdeeee}
table{border-collapse:collapse;background:#fff;border:1px solid var(--line);margin:6px 0}
th,td{padding:4px 8px;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600;font-size:12px}
table.num td{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.num td:first-child{text-align:left}
table.top{width:100%}
table.top td{font-variant-numeric:tabular-nums}
table.top td:not(:last-child){white-space:nowrap}
table.small{font-size:12px}
.note{color:var(--muted);margin:6px 0;max-width:1240px}
.muted{color:var(--muted)}
details summary{cursor:pointer}
ol.stack{margin:4px 0 2px;padding-left:22px;font:12px/1.4 ui-monospace,Menlo,"DejaVu Sans Mono",
monospace;word-break:break-all}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;margin:6px 0;font-size:12px}
.legend i{display:inline-block;width:14px;height:12px;margin-right:5px;vertical-align:-1px;
border:1px solid rgba(0,0,0,.15)}
.map{display:flex;flex-wrap:wrap;gap:3px;background:#fff;border:1px solid var(--line);
padding:6px}
.seg{display:flex;height:26px;border:1px solid #8994a3;background:var(--r);overflow:hidden}
.seg.x{border-style:dashed}
.seg i,.legend i.a,.legend i.p,.legend i.f,.legend i.r{display:block;height:100%}
.seg i{flex:none;border-right:1px solid rgba(255,255,255,.55)}
i.a{background:var(--a)}i.p{background:var(--p)}i.f{background:var(--f)}i.r{background:var(--r)}
.legend i.a,.legend i.p,.legend i.f,.legend i.r{display:inline-block;height:12px}
i.la{background:var(--a)}i.lr{background:#34495e}i.lo{background:#d62728}
i.ls{background:#1a9850}i.lf{background:#7f7f7f}
svg.chart{background:#fff;border:1px solid var(--line);display:block}
svg .grid{stroke:#eceff3}
svg .frame{fill:none;stroke:#b8c0cb}
svg .tick{font-size:11px;fill:var(--muted)}
svg .axis{font-size:12px;fill:var(--muted)}
svg .allocated{fill:none;stroke:var(--a);stroke-width:1.5}
svg .area{fill:var(--a);fill-opacity:.12;stroke:none}
svg .reserved{fill:none;stroke:#34495e;stroke-width:1.5;stroke-dasharray:5 3}
svg .oom line{stroke:#d62728;stroke-width:1.5;stroke-dasharray:3 2}
svg .oom text{fill:#d62728;font-size:11px;font-weight:700}
.side{margin-top:8px}
.empty{background:#fff;border:1px dashed #b8c0cb;padding:10px 12px;color:var(--muted)}
"""
)

# The page is HTML and CSS only: no script may run in it, inline or not.
PAGE_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def render_html(
    snapshot: Mapping[str, Any],
    *,
    title: str = "CUDA allocator snapshot",
    meta: Mapping[str, Any] | None = None,
    top_n: int = 50,
    max_segments: int = 1500,
    max_items: int = MAX_RENDER_ITEMS,
    max_frames: int = MAX_RENDER_FRAMES,
    max_page_chars: int = MAX_PAGE_CHARS,
) -> str:
    """One self-contained HTML page for a snapshot dict; loads nothing from anywhere.

    `meta` (host, pid, trigger, replay, ...) is shown in the header; a truthy "replay" adds a
    banner saying the data is a recording, not a live process. A snapshot that needs more
    than `max_items` items or `max_frames` frames walked (see MAX_RENDER_ITEMS and
    MAX_RENDER_FRAMES), more than MAX_DEVICES devices, or a page over `max_page_chars`
    raises SnapshotError, before the work rather than after it where it can.
    """
    budget = Budget(max_items, max_frames, max_page_chars)
    count_work(snapshot, budget)
    segments = segments_of(snapshot)
    traces = traces_of(snapshot)
    by_device: dict[int, list[Segment]] = {}
    for seg in segments:
        by_device.setdefault(seg.device, []).append(seg)
    n_devices = len(by_device.keys() | traces.keys())
    if n_devices > MAX_DEVICES:
        raise SnapshotError(
            f"too large to render: {n_devices} devices, more than the {MAX_DEVICES} drawn"
        )

    # The OOM's verdict: in the pickle itself (a downloaded snapshot, offline) or in the
    # snapshot store's sidecar (exporter.actions.oom writes both).
    verdict = snapshot.get(SNAPSHOT_KEY) or (meta or {}).get("oom")
    names = pool_names(meta, verdict)
    sections = _sections(snapshot, segments, by_device, traces, top_n, max_segments, budget, names)
    return _page(title, meta, sections, _verdict_html(verdict))


def pool_names(meta: Mapping[str, Any] | None, verdict: Any) -> dict[str, str]:
    """The names the server gave its private pools (exporter.name_pool), by the viewer's pool
    id ("0,1"): from the snapshot's sidecar, and from its OOM verdict."""
    found: dict[str, str] = {}
    for source in ((meta or {}).get("pool_names"), (verdict or {}).get("private_pool_names")):
        if isinstance(source, Mapping):
            for pool, name in source.items():
                if isinstance(pool, str) and isinstance(name, str) and name:
                    found[pool.replace("_", ",")] = name[:64]
    return found


def _sections(
    snapshot: Mapping[str, Any],
    segments: list[Segment],
    by_device: dict[int, list[Segment]],
    traces: dict[int, list[TraceEntry]],
    top_n: int,
    max_segments: int,
    budget: Budget,
    names: Mapping[str, str],
) -> list[tuple[str, str, Html]]:
    """The page's sections: (anchor, heading, content)."""
    sections: list[tuple[str, str, Html]] = []
    summary = _summary_html(segments, by_device, traces, snapshot)
    sections.append(("summary", "Summary", budget.page(summary)))

    if segments:
        maps = join(
            html(
                "<h3>cuda:{device}</h3>{map}",
                device=d,
                map=_segment_map_html(by_device[d], max_segments, budget, names),
            )
            for d in sorted(by_device)
        )
        seg_body = _LEGEND + maps
        top_body = budget.page(_top_blocks_html(segments, top_n))
        sites_body = budget.page(_sites_html(segments))
    else:
        seg_body = top_body = sites_body = Html(
            '<p class="muted">No segments: the allocator held no memory when the snapshot '
            "was taken.</p>"
        )
    sections.append(("segments", "Segment map", seg_body))
    sections.append(("top", f"Biggest live allocations (top {top_n})", top_body))
    sections.append(("sites", "Live memory by allocation stack", sites_body))

    if traces:
        timelines = []
        for d in sorted(traces):
            t = totals_of(by_device.get(d, ()))
            timelines.append(budget.page(_timeline_html(d, traces[d], t.active, t.reserved)))
        timeline_body = join(timelines)
    else:
        timeline_body = html('<p class="empty">{message}</p>', message=NO_HISTORY_MESSAGE)
    sections.append(("timeline", "Timeline of the recorded history", timeline_body))
    settings = budget.page(_settings_html(snapshot.get("allocator_settings")))
    sections.append(("settings", "Allocator settings", settings))
    annotations = as_list(snapshot.get("external_annotations"))
    if annotations:
        rows = [[as_text(a)] for a in annotations[:50]]
        sections.append(
            (
                "annotations",
                f"External annotations ({len(annotations)})",
                _table(["annotation"], rows, "small"),
            )
        )

    return sections


def _page(
    title: str,
    meta: Mapping[str, Any] | None,
    sections: list[tuple[str, str, Html]],
    verdict: Html,
) -> str:
    nav = join(
        html('<a href="#{sid}">{name}</a>', sid=sid, name=name.split(" (")[0])
        for sid, name, _ in sections
    )
    body = join(
        html(
            '<section id="{sid}"><h2>{name}</h2>{content}</section>',
            sid=sid,
            name=name,
            content=content,
        )
        for sid, name, content in sections
    )
    banner = (
        Html('<div class="banner">Replay: this snapshot is a recording, not a live process.</div>')
        if meta and meta.get("replay")
        else Html("")
    )
    return html(
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer">'
        "<title>{title}</title><style>{css}</style></head>"
        "<body><main><h1>{title}</h1>{meta}{banner}{verdict}<nav>{nav}</nav>"
        "{body}</main></body></html>\n",
        csp=Html(PAGE_CSP),
        title=title,
        css=_CSS,
        meta=_meta_html(meta),
        banner=banner,
        verdict=verdict,
        nav=nav,
        body=body,
    )
