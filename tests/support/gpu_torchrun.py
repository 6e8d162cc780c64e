"""Two ranks under torchrun, for the `gpumem-exporter run` GPU test (tests/gpu/test_gpu.py).

Rank r sets device r and holds (r + 1) x 256 MiB. On CONTROL files:
- `oom1`: rank 1 caps itself at 2 GiB, makes the allocator flush and retry, then runs out of
  memory (caught, as a server answering one request with an error does);
- `validate`: rank 0 starts a persistent validation worker (CPU only, never CUDA) that loads
  every tensor file given on the command line into a list and holds them;
- `grow`: rank 0 then grows its GPU memory by 48 GiB, 2 GiB at a time (the profiler).
Everything stops when CONTROL/stop exists.
"""

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

MiB, GiB = 1 << 20, 1 << 30


def validate(control: str, files: list[str]) -> None:
    held = [torch.load(f) for f in files]  # the incident: everything into a list first
    Path(control, "validator-ready").write_text(str(os.getpid()))
    while not Path(control, "stop").exists():
        time.sleep(0.1)
    del held


def oom_on_rank1() -> str:
    torch.cuda.set_per_process_memory_fraction(
        (2 * GiB) / torch.cuda.get_device_properties(1).total_memory, 1
    )
    cached = torch.empty(GiB, dtype=torch.uint8, device="cuda:1")
    del cached  # a cached free segment the next, larger request cannot use
    retried = torch.empty(1200 * MiB, dtype=torch.uint8, device="cuda:1")  # flush and retry
    del retried
    try:
        torch.empty(4 * GiB, dtype=torch.uint8, device="cuda:1")
    except torch.cuda.OutOfMemoryError:
        return "oom"
    return "no oom"


def main() -> None:
    rank = int(os.environ["RANK"])
    control, files = sys.argv[1], sys.argv[2:]
    os.environ["GPUMEM_ROLE"] = f"rank{rank}"
    torch.cuda.set_device(rank)
    held = [torch.empty((rank + 1) * 256 * MiB, dtype=torch.uint8, device=f"cuda:{rank}")]
    torch.cuda.synchronize()
    Path(control, f"ready{rank}").write_text(str(os.getpid()))
    validator = None
    while not Path(control, "stop").exists():
        if rank == 1 and Path(control, "oom1").exists() and not Path(control, "oom1-done").exists():
            Path(control, "oom1-done").write_text(oom_on_rank1())
        if rank == 0 and Path(control, "validate").exists() and validator is None:
            os.environ["GPUMEM_ROLE"] = "validate"  # its start-up environment names it
            validator = mp.get_context("spawn").Process(target=validate, args=(control, files))
            validator.start()
            os.environ["GPUMEM_ROLE"] = "rank0"
        if rank == 0 and Path(control, "grow").exists() and len(held) < 25:
            held.append(torch.empty(2 * GiB, dtype=torch.uint8, device="cuda:0"))
            torch.cuda.synchronize()
            if len(held) == 25:
                Path(control, "grown").touch()
            time.sleep(0.1)  # grow over a few seconds, as the profiler did
            continue
        time.sleep(0.05)
    if validator is not None:
        validator.join(30)


if __name__ == "__main__":
    main()
