"""A multi-process "server" for tests/run/test_run.py: an API process that never touches CUDA and
workers (spawned and forked) that each use one device, like vLLM's engine and TP workers.

Workers live until CONTROL/stop-<name> exists. SIGTERM to the API process stops everything and
exits with status 3, so that the launcher's signal and exit-status pass-through show.
"""

import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path


def worker(name: str, device: int, rank: int, control: str) -> None:
    os.environ["GPUMEM_ROLE"] = name
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["FAKE_TORCH_RETRIES_FILE"] = str(Path(control, f"retries-{name}"))
    import torch

    torch.cuda.set_device(device)  # this worker "initializes CUDA" on its device
    Path(control, f"pid-{name}").write_text(str(os.getpid()))
    Path(control, "run-dir").write_text(os.environ.get("GPUMEM_RUN_DIR", ""))
    if name == "embedded":
        import exporter

        handle = exporter.start(port=9)  # under `run`: must not open a port of its own
        Path(control, "embedded-url").write_text(str(handle.url))
    while not Path(control, f"stop-{name}").exists():
        if Path(control, f"oom-{name}").exists():
            # Uncaught: the worker dies of its OOM, as servers do.
            torch._fake_oom(device)  # type: ignore[attr-defined]
        time.sleep(0.05)


def hog(control: str) -> None:
    """A worker that never uses CUDA and holds host memory, like a validation worker that
    loads captured tensors into a list (2 GiB once CONTROL/hog exists)."""
    held: list[bytes] = []
    while not Path(control, "stop-hog").exists():
        if Path(control, "hog").exists() and not held:
            held.append(b"\x01" * (2 << 30))  # touched, so resident
            Path(control, "hog-ready").write_text(str(os.getpid()))
        time.sleep(0.05)


def main() -> None:
    control = sys.argv[1]
    ctx_spawn, ctx_fork = mp.get_context("spawn"), mp.get_context("fork")
    procs = [
        ctx_spawn.Process(target=worker, args=("worker0", 0, 0, control)),
        ctx_spawn.Process(target=worker, args=("worker1", 1, 1, control)),
        ctx_fork.Process(target=worker, args=("forked", 0, 2, control)),
        ctx_spawn.Process(target=worker, args=("embedded", 1, 3, control)),
    ]
    for p in procs:
        p.start()
    # The hog's role is in its start-up environment (it has no agent to tell the launcher).
    os.environ["GPUMEM_ROLE"] = "hog"
    hogger = ctx_spawn.Process(target=hog, args=(control,))
    hogger.start()
    del os.environ["GPUMEM_ROLE"]
    procs.append(hogger)

    def stop(signum, frame):
        for name in ("worker0", "worker1", "forked", "embedded", "hog"):
            Path(control, f"stop-{name}").touch()
        for p in procs:
            p.join(10)
        sys.exit(3)

    signal.signal(signal.SIGTERM, stop)
    Path(control, "started").touch()
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
