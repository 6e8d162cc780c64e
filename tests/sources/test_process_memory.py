"""exporter.sources.process_memory against real processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from exporter.sources.process_memory import MAX_ENVIRON_BYTES, describe, read_environ


def test_a_huge_environment_is_read_only_up_to_its_bound():
    """A GPU process the node daemon describes is a tenant's: a 1.5 MiB environment costs the
    daemon at most MAX_ENVIRON_BYTES (round 4: reads of what a tenant controls are bounded),
    and what comes first in it is still read."""
    # One string may hold 128 KiB (MAX_ARG_STRLEN): 1.5 MiB in 12 of them.
    huge = {f"HUGE{n}": "x" * (125 << 10) for n in range(12)}
    env = {"RANK": "3", "PATH": os.environ.get("PATH", ""), **huge}
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        found = read_environ(child.pid)
        assert sum(len(k) + len(v) for k, v in found.items()) < MAX_ENVIRON_BYTES
        assert found[b"RANK"] == b"3"
        assert describe(child.pid)["rank"] == "3"
    finally:
        child.communicate(b"")


def _open_files() -> list[str]:
    """What this process's descriptors are open on."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed meanwhile
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
    return found


def _status_descriptors(pid: int) -> int:
    """This process's descriptors open on /proc/PID/status."""
    return _open_files().count(f"/proc/{pid}/status")


def test_a_process_status_is_kept_open_read_fresh_and_closed_when_it_leaves():
    """The tick's /proc/PID/status read keeps the file open (a read instead of an open, a
    read and a close: 55 against 180 us on cold caches), gives the numbers of the moment
    (the child grows by 64 MiB between two reads), and closes it once the process is gone."""
    from exporter.sources.process_memory import KeptStatus, read_status

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; print('up', flush=True); sys.stdin.readline(); "
            "held = bytearray(64 << 20); print('grown', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    kept = KeptStatus("/proc")
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == b"up\n"
        first = kept.read(child.pid)
        assert first is not None and first["rss"] > 0
        assert _status_descriptors(child.pid) == 1
        child.stdin.write(b"grow\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"grown\n"
        grown = kept.read(child.pid)
        assert grown is not None and grown["rss"] >= first["rss"] + (60 << 20)
        assert abs(grown["rss"] - (read_status(child.pid) or {"rss": 0})["rss"]) < 4 << 20
        assert _status_descriptors(child.pid) == 1  # read again, not opened again
    finally:
        child.kill()
        child.communicate()
    assert kept.read(child.pid) is None
    assert _status_descriptors(child.pid) == 0
    kept.close()


def test_the_source_closes_the_files_of_processes_no_longer_listed(tmp_path):
    """A process the source no longer reads (left the tree, left the GPU) has its kept file
    closed at that tick, and all are closed with the source."""
    from exporter.sources.process_memory import ProcessMemorySource

    for pid in (7, 8):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(f"VmRSS:\t{pid} kB\n")
    listed = [7, 8]
    source = ProcessMemorySource(lambda: listed, labels=lambda: {}, proc=str(tmp_path))

    def open_files() -> set[str]:
        return {target for target in _open_files() if target.startswith(str(tmp_path))}

    assert [r.resident_bytes for r in source.read().host_processes] == [7 << 10, 8 << 10]
    assert open_files() == {f"{tmp_path}/7/status", f"{tmp_path}/8/status"}
    (tmp_path / "7" / "status").write_text("VmRSS:\t70 kB\n")  # rewritten in place
    listed = [7]
    assert [r.resident_bytes for r in source.read().host_processes] == [70 << 10]
    assert open_files() == {f"{tmp_path}/7/status"}
    source.close()
    assert open_files() == set()


def test_a_status_longer_than_one_read_is_read_whole(tmp_path):
    """A process in thousands of groups has a Groups line past the first 16 KiB read, with
    VmRSS after it: read once (read_status) and kept open (KeptStatus), it is found."""
    from exporter.sources.process_memory import KeptStatus, read_status

    (tmp_path / "7").mkdir()
    groups = " ".join(str(g) for g in range(100000, 104000))  # ~28 KiB
    (tmp_path / "7" / "status").write_text(f"Name:\tx\nGroups:\t{groups}\nVmRSS:\t5 kB\n")
    assert read_status(7, str(tmp_path)) == {"rss": 5 << 10}
    kept = KeptStatus(str(tmp_path))
    try:
        assert kept.read(7) == {"rss": 5 << 10}
        assert kept.read(7) == {"rss": 5 << 10}  # read again from its start
    finally:
        kept.close()
