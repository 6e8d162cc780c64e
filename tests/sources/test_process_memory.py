"""exporter.sources.process_memory against real processes."""

from __future__ import annotations

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
