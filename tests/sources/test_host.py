"""Host memory read from /proc files kept open: the same numbers psutil reads, fresh on every
read, and a failed read reopens the file rather than keeping a dead descriptor."""

from __future__ import annotations

import os

import psutil
import pytest

from exporter.proc_file import ProcFile
from exporter.sources.host import HostMemorySource, parse_meminfo

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="needs Linux /proc")


def test_the_source_reads_what_psutil_reads() -> None:
    source = HostMemorySource()
    try:
        ballast = bytearray(64 << 20)  # resident: the next reading must see it
        ballast[::4096] = b"x" * len(ballast[::4096])
        host = source.read().host
        assert host is not None and host.process_resident_bytes is not None
        rss = psutil.Process().memory_info().rss
        assert abs(host.process_resident_bytes - rss) < 8 << 20
        assert host.process_resident_bytes > 64 << 20
        memory = psutil.virtual_memory()
        assert host.total_bytes == memory.total
        assert abs(host.available_bytes - memory.available) < 256 << 20
        assert host.swap_total_bytes == psutil.swap_memory().total
        del ballast
    finally:
        source.close()


def test_a_kept_open_file_is_read_afresh(tmp_path) -> None:
    path = tmp_path / "counter"
    path.write_bytes(b"1\n")
    proc_file = ProcFile(str(path))
    assert proc_file.read() == b"1\n"
    with open(path, "r+b") as f:  # the same file, new content (as the kernel rewrites /proc)
        f.write(b"22\n")
    assert proc_file.read() == b"22\n"
    proc_file.close()
    assert proc_file.read() == b"22\n"  # reopened
    proc_file.close()


def test_a_failed_read_reopens(tmp_path) -> None:
    path = tmp_path / "gone"
    path.write_bytes(b"x")
    proc_file = ProcFile(str(path))
    proc_file.read()
    assert proc_file._fd is not None
    os.close(proc_file._fd)  # the descriptor went bad under it
    with pytest.raises(OSError):
        proc_file.read()
    assert proc_file.read() == b"x"
    proc_file.close()


def test_meminfo_fields_in_bytes_wherever_they_sit() -> None:
    data = (
        b"MemTotal: 16384 kB\nMemFree: 1 kB\nSwapTotal: 2 kB\nMemAvailable: 8192 kB\n"
        b"SwapFree: 0 kB\n"
    )
    assert parse_meminfo(data) == {
        "MemTotal": 16384 * 1024,
        "MemAvailable": 8192 * 1024,
        "SwapTotal": 2048,
        "SwapFree": 0,
    }
    assert parse_meminfo(b"HugePages_Total: 0\n") == {}


def test_meminfo_is_read_in_bytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       16384 kB\nMemFree:  1 kB\nMemAvailable:    8192 kB\n"
        "SwapTotal:       2048 kB\nSwapFree:        1024 kB\nHugePages_Total: 0\n"
    )
    assert parse_meminfo(meminfo.read_bytes()) == {
        "MemTotal": 16384 * 1024,
        "MemAvailable": 8192 * 1024,
        "SwapTotal": 2048 * 1024,
        "SwapFree": 1024 * 1024,
    }
