"""Two exporters sharing one snapshot folder from different PID namespaces (two containers,
one volume; issue 38), in real namespaces made with unshare(1): the start-up sweep of one
leaves the other's live capture and its half-written file alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from exporter import atomic
from tests.conftest import REPO_ROOT, require_tool
from tests.helpers import close_pipes

# The writer's container: a few processes first, so that the writer's pid is one the other
# namespace does not have (there only the sweeper's own pid 1 exists).
WRITER = """
import subprocess, sys
for _ in range(6):
    subprocess.run(["true"])
subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]])
"""
CAPTURE = """
import os, sys, time
from exporter import atomic
from exporter.actions.snapshots import SnapshotStore
folder = sys.argv[1]
store = SnapshotStore(folder)
store.reserve("record", meta={"record_s": 60})
def chunks():
    yield b"half"
    print("writing", os.getpid(), flush=True)
    time.sleep(30)
    yield b"the rest"
atomic.write_chunks(os.path.join(folder, "capture.pickle"), chunks())
"""
SWEEPER = """
import os, sys
from exporter.actions.snapshots import SnapshotStore
store = SnapshotStore(sys.argv[1])
print("pid", os.getpid())
print("statuses", sorted(i.status for i in store.list()))
print("temps", sorted(n for n in os.listdir(sys.argv[1]) if n.endswith(".partial")))
"""


def in_namespace(unshare: str, code: str, *args: str, **popen) -> subprocess.Popen[str]:
    argv = [unshare, "-fp", "--mount-proc", "--kill-child", sys.executable, "-c", code, *args]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(argv, env=env, text=True, cwd=REPO_ROOT, **popen)


def test_a_sweep_in_another_pid_namespace_leaves_a_live_capture_alone(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("unshare -p needs root")
    unshare = require_tool("unshare")
    folder = tmp_path / "snapshots"
    writer = in_namespace(
        unshare, WRITER, CAPTURE, str(folder), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert writer.stdout is not None and writer.stderr is not None
    try:
        line = writer.stdout.readline()
        if not line.startswith("writing"):
            pytest.skip(f"cannot make a PID namespace here: {writer.stderr.read()[-300:]}")
        assert int(line.split()[1]) > 1  # its pid in its own namespace
        swept = in_namespace(unshare, SWEEPER, str(folder), stdout=subprocess.PIPE)
        out, _ = swept.communicate(timeout=60)
        close_pipes(swept)
        assert "pid 1" in out  # the sweeper's namespace has no process of the writer's pid
        assert "statuses ['recording']" in out, out
        assert "capture.pickle" in out.split("temps", 1)[1], out  # the temp file is kept
    finally:
        writer.kill()
        writer.wait(timeout=10)
        close_pipes(writer)


def test_a_capture_of_another_namespace_is_abandoned_once_overdue(tmp_path, monkeypatch):
    """Its writer cannot be asked; a capture of 60 s still recording 60 + 120 s later was left
    by a writer that died (its own container's restart would have said so, if it came back)."""
    from exporter.actions import snapshots
    from exporter.actions.snapshots import SnapshotStore

    folder = tmp_path / "snapshots"
    store = SnapshotStore(folder)
    info = store.reserve("record", meta={"record_s": 60})
    sidecar = next(folder.glob("*.json"))
    text = sidecar.read_text().replace(f'"{atomic.pid_namespace()}"', '"1"')
    sidecar.write_text(text)
    assert [i.status for i in SnapshotStore(folder).list()] == ["recording"]
    created = info.created
    monkeypatch.setattr(snapshots.time, "time", lambda: created + 60 + snapshots.OVERDUE_S + 1)
    assert [i.status for i in SnapshotStore(folder).list()] == ["failed"]
