"""bench.loop_lateness's reading of the serving process's CPU (the helper's, or `run`'s
launcher's): fine enough for the milliseconds a second it is there to measure."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from bench.loop_lateness import REPO, _cpu_s

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


def test_a_tree_with_an_older_bench_is_measured_with_this_checkouts_bench(tmp_path):
    """The tree under measurement gives the exporter package only: one whose bench/ lacks a
    helper this bench imports (the last stop's before-tree had no
    helper_cpu.listening_process) is measured all the same, where its arms failed at import."""
    tree = tmp_path / "before"
    (tree / "bench").mkdir(parents=True)
    (tree / "bench" / "__init__.py").write_text("")
    (tree / "bench" / "helper_cpu.py").write_text('"""Older: without what the bench imports."""\n')
    (tree / "exporter").symlink_to(REPO / "exporter", target_is_directory=True)
    command = [sys.executable, "-m", "bench.loop_lateness", "--root", f"{tree}:off"]
    done = subprocess.run(
        [*command, "--seconds", "0.3", "--rounds", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    assert result["root"] == f"{tree}" and result["arm"] == "off" and result["wakeups"] > 0
