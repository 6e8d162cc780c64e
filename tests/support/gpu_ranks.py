"""Two ranks, each on its own GPU, for the `gpumem-exporter run` GPU test: rank r sets device
r and holds (r + 1) x 256 MiB until CONTROL/stop exists."""

import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MiB = 1 << 20


def rank_main(rank: int, control: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GPUMEM_ROLE=f"rank{rank}")
    torch.cuda.set_device(rank)
    held = torch.empty((rank + 1) * 256 * MiB, dtype=torch.uint8, device=f"cuda:{rank}")
    torch.cuda.synchronize()
    Path(control, f"ready{rank}").write_text(str(os.getpid()))
    while not Path(control, "stop").exists():
        time.sleep(0.05)
    del held


if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2, join=True)
