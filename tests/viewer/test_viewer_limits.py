"""The viewer's bounds: hostile or oversized snapshots are refused with a one-line reason,
quickly and in bounded memory, and real large snapshots still render.

A pickle memoizes: an object written once is referenced again for a few bytes. So a file of
a few hundred KiB can hold one segment of 8,500 blocks referenced 10,000 times (85M blocks to
walk: before the limits this took over 9 GB and two minutes), or a tuple nested 40 deep that
takes 2**40 steps to hash. Each test that could hang or exhaust memory without the limits runs
in a child process with a memory cap and a timeout, so that it fails instead.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from exporter.viewer import SnapshotError, load_snapshot, render_html
from tests.conftest import REPO_ROOT

CHILD_MEMORY_BYTES = 2 << 30  # address space of a child: without the limits it hits this
CHILD_TIMEOUT_S = 120  # only reached without the limits; with them a child takes about 1 s

MAX_RENDER_ITEMS = 2_000_000  # the default, written out: a change to it should be deliberate
OVER_ITEMS = "more than 2,000,000 segments, blocks and history entries"


def memo_bomb(n_blocks: int = 8500, n_refs: int = 10_000) -> bytes:
    """One segment of `n_blocks` live blocks, listed `n_refs` times: about 231 KB."""
    blocks = [
        {"address": i << 9, "size": 512, "requested_size": 512, "state": "active_allocated"}
        for i in range(n_blocks)
    ]
    segment = {
        "device": 0,
        "address": 0,
        "total_size": 512 * n_blocks,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "blocks": blocks,
    }
    return pickle.dumps({"segments": [segment] * n_refs}, protocol=4)


def nested_tuple_ops(depth: int) -> bytes:
    """Pickle opcodes that push a tuple nested `depth` deep through the memo: t = (t, t).

    Hand-written, because building such a tuple in Python and hashing it (a dict literal, a
    set) is itself the hang.
    """
    ops = b"\x8c\x01x\x85\x94"  # SHORT_BINUNICODE 'x', TUPLE1, MEMOIZE (memo 0)
    for i in range(depth):  # POP, BINGET i, BINGET i, TUPLE2, MEMOIZE (memo i + 1)
        ops += b"0h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"
    return ops


# PROTO 4, EMPTY_DICT, 'segments', EMPTY_LIST, SETITEM: {"segments": []} with items to follow.
_HEAD = b"\x80\x04}\x8c\x08segments]s"

HASH_BOMBS = {
    # {"segments": [], t40: 1}
    "tuple_key": _HEAD + nested_tuple_ops(40) + b"K\x01s.",
    # {"segments": [], "s": frozenset([t40])}, through the FROZENSET opcode
    "frozenset_item": _HEAD + b"\x8c\x01s(" + nested_tuple_ops(40) + b"\x91s.",
    # {"segments": [], "s": set([t40])}, through builtins.set, as protocols 0-3 write sets
    "set_item": _HEAD
    + b"\x8c\x01s\x8c\x08builtins\x8c\x03set\x93("
    + nested_tuple_ops(40)
    + b"l\x85Rs.",
}


_CHILD = """\
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from exporter.viewer import SnapshotError, load_snapshot, render_html
rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
result = {{}}
try:
{code}
except SnapshotError as exc:
    result["error"] = str(exc)
except MemoryError:
    result["error"] = "MemoryError"
result["elapsed_s"] = time.perf_counter() - started
rss_after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result["rss_increase_mb"] = (rss_after_kib - rss_before_kib) / 1024
print(json.dumps(result))
"""


def cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))


def run_child(code: str, *args: str) -> dict[str, Any]:
    """Run `code` in a fresh interpreter with a memory cap; it prints one JSON line."""
    body = textwrap.indent(textwrap.dedent(code).strip(), "    ")
    script = _CHILD.format(limit=CHILD_MEMORY_BYTES, code=body)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            cwd=REPO_ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not finish in {CHILD_TIMEOUT_S} s")
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- the reported defect: references walked again and again ----------------------------------


def test_memo_bomb_is_refused_at_once_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "bomb.pickle"
    path.write_bytes(memo_bomb())
    assert 200_000 < path.stat().st_size < 260_000  # the reported file was 231 KB
    result = run_child(
        """
        snapshot = load_snapshot(sys.argv[1])
        render_html(snapshot)
        """,
        str(path),
    )
    assert "too large to render" in result.get("error", ""), result
    assert OVER_ITEMS in result["error"]
    assert result["rss_increase_mb"] < 500, result  # about 5 MB; before, over 9 GB
    assert result["elapsed_s"] < 60, result  # about 0.05 s; before, over 120 s


def test_the_walk_is_counted_before_anything_is_built() -> None:
    # Just over and just under the limit: the count includes every repeated reference.
    segment: dict[str, Any] = {"device": 0, "total_size": 1 << 20, "blocks": [{"size": 1}] * 99}
    over = {"segments": [segment] * (MAX_RENDER_ITEMS // 100 + 1)}
    with pytest.raises(SnapshotError, match=OVER_ITEMS):
        render_html(over)
    with pytest.raises(SnapshotError, match="more than 10 segments, blocks and history"):
        render_html({"segments": [segment]}, max_items=10)
    entries = [{"action": "alloc", "size": 1, "time_us": 1}] * 6
    with pytest.raises(SnapshotError, match="more than 10 segments, blocks and history"):
        render_html({"segments": [], "device_traces": [entries, entries]}, max_items=10)
    frames = [{"filename": "train.py", "line": 1, "name": "step"}] * 6
    live = {"size": 1, "state": "active_allocated", "frames": frames}
    with pytest.raises(SnapshotError, match="more than 10 stack frames of live blocks"):
        render_html({"segments": [{"blocks": [live, live]}]}, max_frames=10)
    # Frames of free blocks are not read, so they do not count.
    free = {"size": 1, "state": "inactive", "frames": frames}
    assert "<!DOCTYPE html>" in render_html({"segments": [{"blocks": [free] * 5}]}, max_frames=10)
    assert "<!DOCTYPE html>" in render_html({"segments": [segment]}, max_items=100)


def test_many_devices_and_a_long_page_are_refused() -> None:
    segments = [{"device": d, "total_size": 1 << 20, "blocks": []} for d in range(65)]
    with pytest.raises(SnapshotError, match="65 devices, more than the 64 drawn"):
        render_html({"segments": segments})
    assert "cuda:63" in render_html({"segments": segments[:64]})
    with pytest.raises(SnapshotError, match="the page would pass 1,000 characters"):
        render_html({"segments": segments[:1]}, max_page_chars=1000)


def test_values_from_the_file_are_never_stringified_whole(tmp_path: Path) -> None:
    # A list nested 40 deep through shared references: str() of it would not end.
    deep: list[Any] = []
    for _ in range(40):
        deep = [deep, deep]
    huge = 10**5000  # str() of it raises ValueError: int too large to convert
    block = {"size": huge, "state": deep, "frames": [{"filename": deep, "name": "x" * 10**6}]}
    segment = {"device": huge, "segment_type": deep, "segment_pool_id": deep, "blocks": [block]}
    snapshot = {
        "segments": [segment],
        "device_traces": [[{"action": deep, "size": huge, "time_us": float("inf")}]],
        "allocator_settings": {"a": deep, "b": {"c": deep}, "d": huge},
        "external_annotations": [deep, huge],
    }
    path = tmp_path / "deep.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    assert path.stat().st_size < 1_100_000
    result = run_child(
        """
        page = render_html(load_snapshot(sys.argv[1]))
        result["cut"] = "x" * 2000 + "\u2026" in page and "x" * 2001 not in page
        """,
        str(path),
    )
    assert result.get("cut") is True, result  # rendered, and long texts are cut
    assert result["elapsed_s"] < 60, result  # about 0.1 s; before, it never ended


@pytest.mark.slow
def test_a_history_that_does_not_add_up_renders_in_linear_time(tmp_path: Path) -> None:
    # More allocated than freed, yet no segments: the replay goes below zero and is shifted
    # up. The shift took the minimum once per entry (150k entries: about 3 minutes).
    trace = [
        {"action": "free_completed" if i % 2 else "alloc", "addr": i, "size": 513 - i % 2}
        | {"time_us": 1_763_700_000_000_000 + i}
        for i in range(150_000)
    ]
    path = tmp_path / "history.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    result = run_child(
        """
        page = render_html(load_snapshot(sys.argv[1]))
        result["shifted"] = "does not add up" in page
        """,
        str(path),
    )
    assert result.get("shifted") is True, result
    assert result["elapsed_s"] < 60, result  # about 2 s


# -- loading: work bounded per opcode, not per byte ------------------------------------------


@pytest.mark.parametrize("name", sorted(HASH_BOMBS))
def test_keys_that_take_hours_to_hash_are_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(HASH_BOMBS[name])
    assert path.stat().st_size < 400
    result = run_child("load_snapshot(sys.argv[1])", str(path))
    assert result.get("error", "").endswith("refusing a dict key or set item of type tuple")
    assert result["elapsed_s"] < 60, result  # about 1 ms; before, 2**40 hash steps (hours)


def test_keys_that_collide_are_refused(tmp_path: Path) -> None:
    # Ints equal modulo 2**61 - 1 share a hash: 30,000 of them as keys of one dict take
    # 30,000**2 / 2 comparisons. Keys beyond 64 bits are refused, which leaves at most 16
    # ints per hash value.
    p = (1 << 61) - 1
    path = tmp_path / "collide.pickle"
    keys = {7 + k * p: 0 for k in range(1, 1001)}  # fewer here: building it is quadratic too
    path.write_bytes(pickle.dumps({"segments": [], "x": keys}))
    with pytest.raises(SnapshotError, match="an integer beyond 64 bits"):
        load_snapshot(path)
    fine = tmp_path / "fine.pickle"
    fine.write_bytes(pickle.dumps({"segments": [], "ids": {1: "a", -(1 << 63): "b", 2.5: "c"}}))
    assert load_snapshot(fine)["ids"][-(1 << 63)] == "b"


@pytest.mark.slow
def test_objects_made_by_the_unpickler_are_counted(tmp_path: Path) -> None:
    # A million empty dicts cost 2 bytes each in the file (EMPTY_DICT, MEMOIZE) and about
    # 150 bytes in memory; each dict and each memo entry counts.
    path = tmp_path / "dicts.pickle"
    path.write_bytes(pickle.dumps({"segments": [{} for _ in range(1_000_000)]}, protocol=4))
    with pytest.raises(SnapshotError, match="more than 1,000,000 containers, strings"):
        load_snapshot(path, max_objects=1_000_000)
    assert len(load_snapshot(path, max_objects=2_000_100)["segments"]) == 1_000_000


def test_copies_made_from_one_memoized_argument_are_counted(tmp_path: Path) -> None:
    # protocol 0-2 bytes are _codecs.encode(str, "latin1"): a pickle can call it 10,000
    # times on one memoized 1 MB string (5 bytes a call), 10 GB of copies from 1 MB.
    ops = b"\x80\x02}\x8c\x08segments]s\x8c\x01b("  # {"segments": []}, key "b", MARK
    ops += b"c_codecs\nencode\n\x94"  # GLOBAL, MEMOIZE (memo 0)
    ops += b"X" + (1 << 20).to_bytes(4, "little") + b"x" * (1 << 20)  # BINUNICODE 1 MiB
    ops += b"\x8c\x06latin1\x86\x94"  # 'latin1', TUPLE2, MEMOIZE (memo 1)
    ops += b"R"  # REDUCE: the first copy
    ops += b"h\x00h\x01R" * 9_999  # BINGET 0, BINGET 1, REDUCE: 9,999 more
    ops += b"ls."  # LIST, SETITEM, STOP
    path = tmp_path / "copies.pickle"
    path.write_bytes(ops)
    assert path.stat().st_size < 1_200_000
    result = run_child("load_snapshot(sys.argv[1], max_objects=2_000_000)", str(path))
    assert "more than 2,000,000 containers, strings and references" in result["error"], result
    assert result["rss_increase_mb"] < 500, result  # before, 10 GB


def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class RunsCommand:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
        path = tmp_path / f"system{protocol}.pickle"
        path.write_bytes(pickle.dumps({"segments": [], "x": RunsCommand()}, protocol=protocol))
        with pytest.raises(SnapshotError, match=r"refusing to unpickle (posix|os)\.system"):
            load_snapshot(path)
    assert not marker.exists()


# -- legitimate large snapshots still render ------------------------------------------------


def large_snapshot(live_blocks: int = 50_000, entries: int = 100_000) -> dict[str, Any]:
    """Shaped as torch 2.11 writes one (captured on an H100): one dict per distinct frame,
    shared by every stack that holds it, 8 blocks to a segment, a history of alloc, free and
    segment events with times in microseconds."""
    frames = [
        {"filename": f"/src/model/layer{i % 40}.py", "line": i, "name": f"forward_{i % 97}"}
        for i in range(2000)
    ]
    stacks = [[frames[(i * 7 + j) % 2000] for j in range(30)] for i in range(5000)]
    segments = []
    for s in range(live_blocks // 8):
        base = (1 << 40) + s * (32 << 20)
        blocks = [
            {
                "address": base + b * (4 << 20),
                "size": 4 << 20,
                "requested_size": (4 << 20) - 512,
                "state": "active_allocated",
                "frames": stacks[(s * 8 + b) % 5000],
            }
            for b in range(8)
        ]
        segments.append(
            {
                "device": 0,
                "address": base,
                "total_size": 32 << 20,
                "allocated_size": 32 << 20,
                "active_size": 32 << 20,
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": blocks,
            }
        )
    actions = ("alloc", "free_requested", "free_completed")
    trace = [
        {
            "action": actions[i % 3],
            "addr": (1 << 41) + (i // 3) * 4096,
            "size": 4096,
            "stream": 0,
            "time_us": 1_763_700_000_000_000 + i * 10,
            "frames": stacks[i % 5000],
        }
        for i in range(entries)
    ]
    return {
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": {"max_split_size": -1, "expandable_segments": False},
        "external_annotations": [],
    }


@pytest.mark.slow
def test_a_large_real_shaped_snapshot_renders(tmp_path: Path) -> None:
    # 50k live blocks with 30-frame stacks and a 100k-entry history: 0.16M items, 1.5M frames.
    path = tmp_path / "large.pickle"
    path.write_bytes(pickle.dumps(large_snapshot(), protocol=pickle.HIGHEST_PROTOCOL))
    snapshot = load_snapshot(path)
    page = render_html(snapshot)
    assert "50000 blocks" in page and "100000 entries" in page
    assert "/src/model/layer" in page


# -- the two front doors ---------------------------------------------------------------------


@pytest.mark.slow
def test_cli_view_prints_one_line_and_fails(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.pickle"
    bomb.write_bytes(memo_bomb())
    done = subprocess.run(
        [sys.executable, "-m", "exporter.cli", "view", str(bomb), "-o", str(tmp_path / "o.html")],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        preexec_fn=cap_memory,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("gpumem-exporter view: error: ")
    assert OVER_ITEMS in lines[0] and str(bomb) in lines[0]
    assert not (tmp_path / "o.html").exists()


def test_http_view_of_a_bomb_is_a_4xx_with_the_reason(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from exporter.config import load_config
    from exporter.http.server import create_app
    from exporter.runtime import build_runtime
    from exporter.sources.replay import ReplaySource

    token = "limits-token"
    auth = {"Authorization": f"Bearer {token}"}
    config = load_config(env={}, snapshot_dir=str(tmp_path / "snaps"), admin_token=token)
    runtime = build_runtime(config, mode="demo", sources=[ReplaySource()])
    client = TestClient(create_app(runtime))
    bomb = pickle.loads(memo_bomb(n_blocks=1000, n_refs=3000))  # shared, as the file has it
    info = runtime.actions.store.write(bomb, "api")
    started = time.perf_counter()
    response = client.get(f"/snapshots/{info.id}/view", headers=auth)
    assert time.perf_counter() - started < 60  # about 0.1 s
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert OVER_ITEMS in response.json()["detail"]
