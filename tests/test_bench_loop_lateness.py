"""bench.loop_lateness's reading of the serving process's CPU (the helper's, or `run`'s
launcher's): fine enough for the milliseconds a second it is there to measure."""

from __future__ import annotations

import subprocess
import sys

import psutil

from bench.loop_lateness import _cpu_s

_BURN = """
import sys, time
print("up", flush=True)
sys.stdin.readline()
started = time.thread_time()
while time.thread_time() - started < 0.003:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""


def test_a_few_milliseconds_of_cpu_are_read_as_such_not_in_clock_ticks():
    """3 ms of CPU read as 3 ms: psutil's cpu_times() counts 10 ms clock ticks, which read a
    helper's ~25 ms over a 10 s arm as 1.0 or 2.0 ms/s."""
    child = subprocess.Popen(
        [sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "up\n"
        process = psutil.Process(child.pid)
        before = _cpu_s(process)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "burnt\n"
        after = _cpu_s(process)
        assert before is not None and after is not None
        assert 0.0025 < after - before < 0.009, after - before
    finally:
        child.kill()
        child.communicate()
    assert _cpu_s(process) is None  # gone
    assert _cpu_s(None) is None
