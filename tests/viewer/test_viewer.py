"""The offline snapshot viewer: safe loading, what the page shows, and that it loads nothing."""

from __future__ import annotations

import copy
import gzip
import os
import pickle
import re
import subprocess
import time
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from exporter.actions.replay import demo_snapshot_path
from exporter.units import fmt_bytes as _fmt_bytes
from exporter.viewer import NO_HISTORY_MESSAGE, SnapshotError, load_snapshot, render_html
from exporter.viewer.model import TraceEntry
from exporter.viewer.model import replay_of as _replay
from tests.conftest import require_tool
from tests.helpers import decode_png

DEMO = demo_snapshot_path()


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    return load_snapshot(DEMO)


@pytest.fixture(scope="module")
def demo_html(demo: dict[str, Any]) -> str:
    return render_html(demo, title="demo", meta={"host": "node-1", "pid": 42, "replay": True})


def block(size: int, state: str = "active_allocated", frames: Any = None, **kw: Any) -> dict:
    b = {"address": kw.pop("address", 0), "size": size, "requested_size": size, "state": state}
    if frames is not None:
        b["frames"] = frames
    return b | kw


def segment(address: int, blocks: list[dict], device: int = 0, **kw: Any) -> dict:
    total = sum(b["size"] for b in blocks)
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "blocks": blocks,
    } | kw


# -- load_snapshot ---------------------------------------------------------------------------


@pytest.mark.slow
def test_load_real_snapshot(demo: dict[str, Any]) -> None:
    assert set(demo) >= {"segments", "device_traces", "allocator_settings"}
    assert len(demo["segments"]) > 50
    # Taken at the OOM with history on: the OOM is in its trace.
    assert any(e["action"] == "oom" for e in demo["device_traces"][0])


def test_load_plain_pickle_and_older_protocols(tmp_path: Path) -> None:
    snap = {"segments": [segment(4096, [block(512)])], "tags": {1, 2}, "raw": b"\x00\xff"}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{protocol}.pickle"
        path.write_bytes(pickle.dumps(snap, protocol=protocol))  # sets/bytes need globals < 4
        assert load_snapshot(path) == snap


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="no such file"):
        load_snapshot(tmp_path / "missing.pickle")
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a pickle\n")
    with pytest.raises(SnapshotError, match="not a pickle"):
        load_snapshot(text)
    zipped_text = tmp_path / "notes.gz"
    zipped_text.write_bytes(gzip.compress(b"hello"))
    with pytest.raises(SnapshotError, match="not a pickle"):
        load_snapshot(zipped_text)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(SnapshotError, match="empty"):
        load_snapshot(empty)
    obj: object
    for obj in ([1, 2, 3], {"device_traces": []}):
        other = tmp_path / "other.pickle"
        other.write_bytes(pickle.dumps(obj))
        with pytest.raises(SnapshotError, match="not an allocator snapshot"):
            load_snapshot(other)
    with pytest.raises(SnapshotError, match="directory"):
        load_snapshot(tmp_path)
    # Messages are one line, and SnapshotError is a ValueError for callers that catch those.
    with pytest.raises(ValueError, match=r"^[^\n]+$"):
        load_snapshot(text)


def test_load_refuses_a_gzip_bomb(tmp_path: Path) -> None:
    path = tmp_path / "big.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps({"segments": [], "pad": "x" * 100_000})))
    with pytest.raises(SnapshotError, match="larger than"):
        load_snapshot(path, max_bytes=10_000)


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


class _Evals:
    def __reduce__(self) -> tuple[Any, ...]:
        return (eval, ("__import__('os').getpid()",))


def test_load_refuses_malicious_pickles(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payloads = {
        "system.pickle": pickle.dumps({"segments": [], "x": _RunsCommand(f"touch {marker}")}),
        "system.pickle.gz": gzip.compress(pickle.dumps(_RunsCommand(f"touch {marker}"))),
        "eval.pickle": pickle.dumps({"segments": [_Evals()]}),
        # An object rebuilt through copyreg, as any pickled class instance is at protocol 0.
        "object.pickle": pickle.dumps({"segments": [TraceEntry("alloc", 0, 0, 0, 0)]}, 0),
    }
    for name, data in payloads.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(SnapshotError, match="refusing to unpickle"):
            load_snapshot(path)
    assert not marker.exists()


# -- render_html on the real snapshot --------------------------------------------------------


def _live(snap: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for s in snap["segments"] for b in s["blocks"] if b["state"] != "inactive"]


def test_fmt_bytes() -> None:
    assert _fmt_bytes(0) == "0 B"
    assert _fmt_bytes(1023) == "1023 B"
    assert _fmt_bytes(1536) == "1.50 KiB"
    assert _fmt_bytes(172 << 20) == "172 MiB"
    assert _fmt_bytes(int(15.6 * (1 << 30))) == "15.6 GiB"


@pytest.mark.slow
def test_render_real_snapshot_summary(demo: dict[str, Any], demo_html: str) -> None:
    segs = demo["segments"]
    reserved = sum(s["total_size"] for s in segs)
    allocated = sum(
        b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated"
    )
    inactive = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "inactive")
    fragmented = sum(
        b["size"]
        for s in segs
        if any(b["state"] != "inactive" for b in s["blocks"])
        for b in s["blocks"]
        if b["state"] == "inactive"
    )
    blocks = sum(len(s["blocks"]) for s in segs)
    assert allocated == sum(s["allocated_size"] for s in segs)  # the snapshot agrees
    summary = demo_html.split('<section id="summary">')[1].split("</section>")[0]
    assert f">{_fmt_bytes(reserved)}<" in summary
    assert f">{_fmt_bytes(allocated)}<" in summary
    assert f">{_fmt_bytes(inactive)}<" in summary
    assert f"{100 * fragmented / reserved:.1f}%" in summary
    assert f"{len(segs)} segments" in summary
    assert f"{blocks} blocks" in summary
    assert "max_split_size" in demo_html and "expandable_segments" in demo_html
    assert "node-1" in demo_html and "Replay" in demo_html  # meta and the replay banner


@pytest.mark.slow
def test_render_real_snapshot_allocations_and_stacks(demo: dict[str, Any], demo_html: str) -> None:
    top = demo_html.split('<section id="top">')[1].split("</section>")[0]
    biggest = max(_live(demo), key=lambda b: b["size"])
    first_row = top.split("<tbody>")[1].split("</tr>")[0]
    assert f"<b>{_fmt_bytes(biggest['size'])}</b>" in first_row
    assert f"0x{biggest['address']:x}" in first_row
    assert top.count("<tr>") == 1 + 50  # header + the default top 50
    # Frames from the snapshot, as filename:line function.
    frame = next(b["frames"][0] for b in _live(demo) if b["frames"])
    assert f"{frame['filename']}:{frame['line']} {frame['name']}" in demo_html
    assert "no stack recorded" in demo_html  # blocks allocated before recording started


def test_render_real_snapshot_timeline(demo: dict[str, Any], demo_html: str) -> None:
    timeline = demo_html.split('<section id="timeline">')[1].split("</section>")[0]
    assert '<svg class="chart"' in timeline
    points = re.search(r'<polyline class="allocated" points="([^"]*)"', timeline)
    assert points and len(points.group(1).split()) > 100
    counts = Counter(e["action"] for e in demo["device_traces"][0])
    for action, n in counts.items():
        assert f"<code>{action}</code></td><td>{n}</td>" in timeline
    assert " s</text>" in timeline and "GiB</text>" in timeline  # axes in seconds and GiB
    assert NO_HISTORY_MESSAGE not in demo_html


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.tags: Counter[str] = Counter()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        for name, value in attrs:
            if name in ("src", "href", "action", "srcset", "poster", "data", "xlink:href"):
                self.refs.append((tag, name, value or ""))


def test_page_loads_nothing_external(demo_html: str) -> None:
    parser = _Refs()
    parser.feed(demo_html)
    for tag, name, value in parser.refs:
        assert value.startswith(("#", "data:")), (tag, name, value)
    assert parser.tags["link"] == 0 and parser.tags["iframe"] == 0 and parser.tags["img"] == 0
    lowered = demo_html.lower()
    for needle in ("http://", "https://", "//cdn", "<script src", "<link", "@import", "url("):
        assert needle not in lowered, needle
    # No script at all: the policy allows none, and the page needs none.
    assert (
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; img-src data:\">"
    ) in demo_html
    assert parser.tags["script"] == 0


@pytest.mark.slow
def test_page_size_and_render_time(demo: dict[str, Any]) -> None:
    started = time.perf_counter()
    page = render_html(demo)
    elapsed = time.perf_counter() - started
    assert len(page.encode()) < 5_000_000
    assert elapsed < 5.0  # about 0.3 s on a laptop core


@pytest.mark.slow
def test_render_is_pure(demo: dict[str, Any], demo_html: str) -> None:
    before = copy.deepcopy(demo["segments"][:5])
    again = render_html(demo, title="demo", meta={"host": "node-1", "pid": 42, "replay": True})
    assert again == demo_html  # deterministic: no clock, no randomness
    assert demo["segments"][:5] == before


# -- synthetic snapshots ---------------------------------------------------------------------


def test_render_empty_snapshot() -> None:
    snap: dict[str, Any]
    for snap in ({"segments": []}, {"segments": [], "device_traces": [[], []]}):
        page = render_html(snap)
        assert NO_HISTORY_MESSAGE in page
        assert "No segments" in page
        assert page.rstrip().endswith("</html>")


def test_render_blocks_without_frames_and_missing_keys() -> None:
    snap = {
        "segments": [
            segment(1 << 20, [block(4096), block(8192, state="inactive")]),
            {"address": 1 << 30, "total_size": 2 << 20},  # no blocks, device, pool or type
            "not a segment",
        ]
    }
    page = render_html(snap)
    assert "no stack recorded" in page
    assert NO_HISTORY_MESSAGE in page
    assert "2.01 MiB" in page  # reserved: 12 KiB + 2 MiB


def test_html_in_frames_and_meta_is_escaped() -> None:
    evil = "<script>alert(1)</script>.py"
    frames = [{"filename": evil, "line": 1, "name": "<img src=x onerror=alert(2)>"}]
    snap = {
        "segments": [segment(1 << 20, [block(1 << 20, frames=frames)])],
        "device_traces": [
            [
                {
                    "action": "alloc",
                    "addr": 1 << 20,
                    "size": 1 << 20,
                    "stream": 0,
                    "time_us": 1,
                    "frames": frames,
                }
            ]
        ],
        "allocator_settings": {'"><script>x</script>': "<b>"},
    }
    page = render_html(snap, title="</title><script>t</script>", meta={"<i>": "<u>"})
    assert "&lt;script&gt;alert(1)&lt;/script&gt;.py" in page
    assert "<script" not in page and "<img" not in page and "<u>" not in page
    parser = _Refs()
    parser.feed(page)
    assert parser.tags["script"] == 0 and parser.tags["img"] == 0


def _trace(*entries: tuple[str, int, int]) -> list[dict[str, Any]]:
    """(action, size, time_us) -> trace entries."""
    return [
        {"action": a, "addr": 0x1000 + i, "size": s, "stream": 0, "time_us": t, "frames": []}
        for i, (a, s, t) in enumerate(entries)
    ]


def test_replay_is_anchored_at_the_snapshot() -> None:
    entries = [
        TraceEntry(a, 0, s, 0, t)
        for a, s, t in [
            ("segment_alloc", 1000, 0),
            ("alloc", 100, 1_000_000),
            ("alloc", 50, 2_000_000),
            ("free_requested", 100, 2_500_000),
            ("free_completed", 100, 3_000_000),
        ]
    ]
    # 200 bytes were live before the window (the ring buffer forgot their allocation).
    replay = _replay(entries, end_allocated=250, end_reserved=3000)
    assert replay.anchored and replay.timed
    assert replay.times_s == [0.0, 1.0, 2.0, 2.5, 3.0]
    assert replay.allocated == [200, 300, 350, 350, 250]
    assert replay.reserved == [3000] * 5
    # History that does not add up to the segments: shown, shifted, and flagged.
    replay = _replay(entries, end_allocated=0, end_reserved=0)
    assert not replay.anchored and min(replay.allocated) == 0


def test_render_timeline_markers() -> None:
    snap = {
        "segments": [segment(1 << 30, [block(3 << 20), block(1 << 20, state="inactive")])],
        "device_traces": [
            _trace(
                ("segment_alloc", 4 << 20, 1_000_000),
                ("alloc", 3 << 20, 1_100_000),
                ("oom", 8 << 30, 1_500_000),
                ("segment_free", 2 << 20, 1_700_000),
                ("snapshot", 0, 2_000_000),
            )
        ],
    }
    page = render_html(snap)
    assert "OOM at 0.5 s: tried to allocate 8.00 GiB" in page
    assert "segment allocated (cudaMalloc) at 0 s: 4.00 MiB" in page
    assert "segment freed (cudaFree)" in page
    assert '<div class="card bad">' in page  # the OOM card is highlighted
    assert "MiB</text>" in page


def test_an_oom_at_the_snapshots_last_moment_keeps_its_whole_label() -> None:
    """A snapshot taken at its OOM has the OOM last: its label went right of the line, past
    the chart's edge, and showed "OC". It goes left of the line there; elsewhere right."""
    snap = {
        "segments": [segment(1 << 30, [block(3 << 20)])],
        "device_traces": [
            _trace(
                ("segment_alloc", 4 << 20, 1_000_000),
                ("oom", 8 << 30, 1_200_000),
                ("alloc", 3 << 20, 1_500_000),
                ("oom", 8 << 30, 2_000_000),
            )
        ],
    }
    labels = re.findall(
        r'<text x="([\d.]+)" y="\d+" text-anchor="(\w+)">OOM</text>', render_html(snap)
    )
    assert [anchor for _, anchor in labels] == ["start", "end"], labels
    assert float(labels[0][0]) < float(labels[1][0])  # both where their OOMs are


def test_render_untimed_history() -> None:
    # Older torch versions have no time_us: the axis falls back to entry numbers.
    trace = [{"action": "alloc", "size": 1 << 20}, {"action": "alloc", "size": 1 << 20}]
    page = render_html({"segments": [], "device_traces": [trace]})
    assert "entry number" in page and "without times" in page


def test_render_thousands_of_segments_is_capped() -> None:
    segs = [segment(i << 21, [block(1 << 20), block(1 << 20, "inactive")]) for i in range(5000)]
    started = time.perf_counter()
    page = render_html({"segments": segs}, max_segments=1000)
    assert time.perf_counter() - started < 5.0
    assert "<b>4000 smaller segments (7.81 GiB) are not drawn</b>" in page
    assert page.count('class="seg') == 1000
    assert len(page) < 5_000_000


def test_tiny_blocks_are_merged() -> None:
    # 4096 blocks of 1 KiB in one 4 MiB segment: far narrower than a pixel each.
    blocks = [block(1024, "active_allocated" if i % 2 else "inactive") for i in range(4096)]
    page = render_html({"segments": [segment(1 << 40, blocks)]})
    pieces = page.split('class="map"')[1].count("<i ")
    assert 0 < pieces < 800
    assert "small blocks" in page


# -- the page in a real browser --------------------------------------------------------------


@pytest.mark.slow
def test_screenshot_in_headless_chromium(demo_html: str, tmp_path: Path) -> None:
    chromium = require_tool("chromium")
    page = tmp_path / "snapshot.html"
    page.write_text(demo_html, encoding="utf-8")
    png = tmp_path / "shot.png"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1400,2000",
            f"--screenshot={png}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=90,
    )
    width, height, bpp, rows = decode_png(png.read_bytes())
    assert (width, height) == (1400, 2000)
    colours: Counter[bytes] = Counter()
    for row in rows[::2]:  # every other pixel of every other row is plenty
        for i in range(0, len(row), 2 * bpp):
            colours[row[i : i + 3]] += 1
    total = sum(colours.values())
    background, _ = colours.most_common(1)[0]
    assert sum(n for c, n in colours.items() if c != background) > 0.3 * total
    assert len(colours) > 50
    # The segment map is drawn: allocated blocks (#2f6fdf) and fragmentation (#f3a5a5).
    assert colours[bytes.fromhex("2f6fdf")] > 0.02 * total
    assert colours[bytes.fromhex("f3a5a5")] > 0.005 * total


def test_the_header_names_a_process_in_words_and_no_history_counts_no_ooms() -> None:
    snap = {"segments": [segment(0, [block(4096)])], "device_traces": []}
    page = render_html(snap, meta={"process": {"pid": "42", "rank": "0", "role": ""}})
    assert "<b>process</b> pid 42 rank 0</span>" in page and "{&#x27;pid" not in page
    # Without history a snapshot cannot tell how many OOMs there were: not 0, unknown.
    cards = re.findall(r'<div class="label">OOMs recorded</div><div class="value">([^<]*)<', page)
    assert cards == ["n/a"]


# -- rendered pages kept ---------------------------------------------------------------------


def test_a_page_is_rendered_once_and_the_oldest_of_more_than_four_is_dropped(
    tmp_path: Path,
) -> None:
    """The admin route's viewer page: a second view is the kept page (the file is not read
    again), and only the last four snapshots viewed are kept."""
    from exporter.viewer.pages import KEPT, RenderedPages

    pages = RenderedPages()
    paths = []
    for n in range(KEPT + 1):
        path = tmp_path / f"s{n}.pickle"
        path.write_bytes(pickle.dumps({"segments": [segment(0, [block(1 << 20)])]}))
        paths.append(path)
    first = pages.page("s0", paths[0], title="s0", meta={"id": "s0"})
    assert "s0" in first
    paths[0].unlink()
    assert pages.page("s0", paths[0], title="s0", meta={"id": "s0"}) is first
    for n in range(1, KEPT + 1):
        pages.page(f"s{n}", paths[n], title=f"s{n}", meta={"id": f"s{n}"})
    with pytest.raises(SnapshotError, match="no such file"):  # dropped: rendered again
        pages.page("s0", paths[0], title="s0", meta={"id": "s0"})
    paths[KEPT].unlink()  # the newest is kept
    assert f"s{KEPT}" in pages.page(f"s{KEPT}", paths[KEPT], title="x", meta={})


def test_a_private_pool_the_server_named_is_shown_by_its_name(tmp_path, monkeypatch) -> None:
    """Issue 65: a pool the server named (exporter.name_pool) was "private pool (CUDA graphs /
    mempool) (0,1)" in the viewer. A snapshot written by the exporter keeps the names in its
    sidecar; an OOM's snapshot has them in its verdict too."""
    from exporter import pools
    from exporter.actions.local import LocalActions
    from exporter.actions.snapshots import SnapshotStore
    from exporter.config import load_config

    snap = {
        "segments": [
            segment(1 << 30, [block(3 << 20)]),
            segment(2 << 30, [block(2 << 20, state="inactive")], segment_pool_id=(0, 1)),
            segment(3 << 30, [block(2 << 20, state="inactive")], segment_pool_id=(1, 0)),
        ],
        "device_traces": [[]],
    }
    names = pools.PoolNames()
    names.name((0, 1), "kv_cache")
    monkeypatch.setattr(pools, "registry", lambda: names)
    config = load_config(env={}, snapshot_dir=str(tmp_path))
    actions = LocalActions(SnapshotStore.for_config(config), config=config)
    monkeypatch.setattr(actions, "capture", lambda: snap)  # torch's _snapshot(), isolated
    written = actions.write_snapshot("api")
    assert written.meta["pool_names"] == {"0_1": "kv_cache"}
    page = render_html(snap, meta=written.meta)
    assert "<h4>private pool kv_cache <code>(0,1)</code>" in page
    assert "<h4>private pool (CUDA graphs / mempool) <code>(1,0)</code>" in page  # unnamed
    verdict = {"private_pool_names": {"1_0": "decode_graphs"}}
    assert "<h4>private pool decode_graphs <code>(1,0)</code>" in render_html(
        snap, meta={"oom": verdict}
    )
