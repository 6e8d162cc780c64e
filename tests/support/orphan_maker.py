"""A command for `gpumem-exporter run` that leaves orphans: it forks COUNT children that each
fork a grandchild and exit at once, so the grandchildren are adopted by the launcher (its
subreaper). Each grandchild holds 32 MiB resident, writes its pid into CONTROL/orphan-<pid>,
and waits for CONTROL/stop; the command itself waits too."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path


def orphan(control: Path) -> None:
    held = b"\x01" * (32 << 20)  # touched, so resident
    (control / f"orphan-{os.getpid()}").write_text(str(len(held)))
    while not (control / "stop").exists():
        time.sleep(0.05)
    os._exit(0)


def main() -> None:
    control, count = Path(sys.argv[1]), int(sys.argv[2])
    for _ in range(count):
        if os.fork() == 0:  # the child: fork the orphan-to-be, then leave it
            if os.fork() == 0:
                orphan(control)
            os._exit(0)
    while not (control / "stop").exists():
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
