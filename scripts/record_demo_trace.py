"""Record the demo trace on a real GPU: an inference-like workload that ends in an incident.

Run on a machine with a CUDA GPU, from the repository root:

    python3 scripts/record_demo_trace.py --out exporter/data/demo_trace.jsonl.gz

The exporter's real sources (allocator, NVML, host) are sampled by the real sampler every
0.5 s while the main thread runs, in phases:

1. serving (0-60 s): a bf16 decoder (12 layers, hidden 4096, ~4.8 GiB of weights) generates
   token by token for request batches of varied batch size, prompt and output length; the KV
   cache grows by torch.cat every 16 tokens, as naive servers do.
2. fragmentation (60-100 s): a "prefix cache" keeps every other block of varied sizes alive,
   so partly used segments pile up and inactive_split / reserved climbs.
3. pressure (100-130 s): traffic goes on under a 20 GiB cap
   (torch.cuda.set_per_process_memory_fraction), so large KV allocations first flush the
   cache and retry, and finally one request runs out of memory (caught, as a server would).
4. recovery (130-150 s): the prefix cache is dropped, empty_cache() returns the cache to the
   driver, traffic resumes.

A snapshot of the allocator (with allocation history recorded during the fragmentation phase)
is also written for the incident tools' demo.
"""

from __future__ import annotations

import argparse
import gzip
import math
import pickle
import random
import socket
import time
from pathlib import Path

import torch

from exporter.sampler import Sampler
from exporter.sources.host import HostMemorySource
from exporter.sources.nvml import NvmlSource
from exporter.sources.torch_allocator import TorchAllocatorSource
from exporter.trace import TraceWriter

GiB = 1 << 30
LAYERS, HIDDEN, FFN, HEADS = 12, 4096, 11008, 32
HEAD_DIM = HIDDEN // HEADS
CAP_BYTES = 20 * GiB
FRAG_TARGET_BYTES = 10 * GiB  # allocated during the fragmentation phase; half stays live
FRAG_ROUND_BYTES = 340 << 20
PHASES = (("serving", 60.0), ("fragmentation", 40.0), ("pressure", 30.0), ("recovery", 20.0))


class Decoder:
    """Enough of a transformer decoder to allocate like one: weights, activations, KV cache."""

    def __init__(self, device: torch.device) -> None:
        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * 0.02

        self.layers = [
            {
                "qkv": w(HIDDEN, 3 * HIDDEN),
                "o": w(HIDDEN, HIDDEN),
                "up": w(HIDDEN, 2 * FFN),
                "down": w(FFN, HIDDEN),
            }
            for _ in range(LAYERS)
        ]
        self.device = device

    def generate(self, batch: int, prompt: int, new_tokens: int) -> None:
        x = torch.randn(batch, prompt, HIDDEN, device=self.device, dtype=torch.bfloat16)
        kv = []
        for layer in self.layers:  # prefill
            qkv = x @ layer["qkv"]
            k, v = qkv[..., HIDDEN : 2 * HIDDEN], qkv[..., 2 * HIDDEN :]
            kv.append([k.contiguous(), v.contiguous()])
            x = torch.nn.functional.silu((x @ layer["o"]) @ layer["up"][:, :FFN]) @ layer["down"]
        step = x[:, -1:, :]
        pending: list[list[torch.Tensor]] = [[] for _ in self.layers]
        for t in range(new_tokens):
            for i, layer in enumerate(self.layers):
                qkv = step @ layer["qkv"]
                pending[i].append(qkv[..., HIDDEN:])
                step = torch.nn.functional.silu((step @ layer["o"]) @ layer["up"][:, :FFN])
                step = step @ layer["down"]
                if (t + 1) % 16 == 0:  # grow the cache in chunks, as naive servers do
                    new = torch.cat(pending[i], dim=1)
                    kv[i][0] = torch.cat([kv[i][0], new[..., :HIDDEN]], dim=1)
                    kv[i][1] = torch.cat([kv[i][1], new[..., HIDDEN:]], dim=1)
                    pending[i] = []
            step = step / (step.norm() + 1)
        torch.cuda.synchronize(self.device)


def serve_one(decoder: Decoder, rng: random.Random, scale: float = 1.0) -> str:
    batch = rng.choice([1, 2, 4, 8, 16, 24, 32])
    prompt = rng.choice([128, 256, 512, 768, 1024, 1536, 2048])
    while batch * prompt > 16384 * scale and batch > 1:
        batch //= 2
    new_tokens = rng.choice([16, 32, 48, 64, 96])
    try:
        decoder.generate(batch, prompt, new_tokens)
    except torch.cuda.OutOfMemoryError:
        return f"OOM batch={batch} prompt={prompt}"
    return f"ok batch={batch} prompt={prompt} new={new_tokens}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("exporter/data/demo_trace.jsonl.gz"))
    parser.add_argument("--snapshot", type=Path, help="also write an allocator snapshot here")
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total, device)

    meta = {
        "description": f"{torch.cuda.get_device_name(device)}: bf16 decoder serving varied "
        "batches, then fragmentation, allocation retries, an OOM and recovery "
        f"under a {CAP_BYTES // GiB} GiB cap",
        "device_name": torch.cuda.get_device_name(device),
        "torch_version": torch.__version__,
        "host": socket.gethostname(),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cap_bytes": CAP_BYTES,
        "interval_s": args.interval_s,
        "phases": [{"name": n, "duration_s": d} for n, d in PHASES],
        "script": "scripts/record_demo_trace.py",
    }
    writer = TraceWriter(args.out, meta=meta)
    sampler = Sampler(
        [TorchAllocatorSource(), NvmlSource(), HostMemorySource()],
        interval_s=args.interval_s,
        listeners=[writer],
    )
    decoder = Decoder(device)
    torch.cuda.synchronize()
    sampler.start()
    prefix_cache: list[torch.Tensor] = []
    frag_bytes, frag_rounds, frag_size = 0, 0, float(1 << 20)
    start = time.monotonic()
    events = []

    def log(message: str) -> None:
        line = f"{time.monotonic() - start:7.1f}s {message}"
        events.append(line)
        print(line, flush=True)

    for phase, duration in PHASES:
        log(f"phase {phase}")
        phase_start = time.monotonic()
        phase_end = phase_start + duration
        if phase == "fragmentation":
            torch.cuda.memory._record_memory_history(max_entries=20000, stacks="python")
        while time.monotonic() < phase_end:
            if phase == "serving":
                log(serve_one(decoder, rng))
            elif phase == "fragmentation":
                # Rounds of blocks, each round's blocks 7% larger than the last round's. Every
                # other block stays alive, so each round leaves holes that later, larger
                # requests cannot use: free space piles up inside partly used segments and
                # inactive_split / reserved climbs, as with a prefix cache of odd sizes.
                progress = min((time.monotonic() - phase_start) / duration, 1.0)
                while frag_bytes < FRAG_TARGET_BYTES * progress:
                    count = max(2, FRAG_ROUND_BYTES // int(frag_size))
                    batch = [
                        torch.empty(int(frag_size), dtype=torch.uint8, device=device)
                        for _ in range(count)
                    ]
                    prefix_cache.extend(batch[::2])
                    frag_bytes += int(frag_size) * count
                    frag_size *= 1.07
                    del batch
                frag_rounds += 1
                if frag_rounds % 4 == 0:
                    stats = torch.cuda.memory_stats_as_nested_dict(device)
                    inactive = stats["inactive_split_bytes"]["all"]["current"]
                    reserved = stats["reserved_bytes"]["all"]["current"]
                    log(
                        f"fragmentation {inactive / reserved:.2f} of {reserved / GiB:.1f} GiB; "
                        + serve_one(decoder, rng, scale=0.25)
                    )
                else:
                    time.sleep(0.2)
            elif phase == "pressure":
                # Traffic goes on while the fragments pin most of the cap. A burst bigger than
                # the cached free blocks that would cross the cap makes the allocator free its
                # cache and retry (num_alloc_retries + 1); one that cannot fit at all is an OOM.
                room = CAP_BYTES - torch.cuda.memory_allocated(device)
                ask = int(room * rng.uniform(0.5, 0.95))
                if ask > 0:
                    try:
                        burst = torch.empty(ask, dtype=torch.uint8, device=device)
                        del burst
                        log(f"burst {ask / GiB:.2f} GiB ok")
                    except torch.cuda.OutOfMemoryError:
                        log(f"burst {ask / GiB:.2f} GiB OOM")
                log(serve_one(decoder, rng))
                if phase_end - time.monotonic() < 8 and not any("OOM" in e for e in events):
                    try:  # the request that no cache flush can satisfy
                        huge = torch.empty(CAP_BYTES, dtype=torch.uint8, device=device)
                        del huge
                    except torch.cuda.OutOfMemoryError:
                        log("OOM on a request for the whole cap (shed)")
            else:  # recovery
                if prefix_cache:
                    prefix_cache.clear()
                    torch.cuda.empty_cache()
                    log("prefix cache dropped, empty_cache()")
                log(serve_one(decoder, rng))
        if phase == "fragmentation":
            if args.snapshot is not None:
                snapshot = torch.cuda.memory._snapshot()
                with gzip.open(args.snapshot, "wb") as f:
                    pickle.dump(snapshot, f)
                log(f"snapshot written to {args.snapshot}")
            torch.cuda.memory._record_memory_history(enabled=None)
    sampler.stop()
    path = writer.close()
    stats = torch.cuda.memory_stats(device)
    print(
        f"wrote {writer.count} samples to {path}; retries={stats['num_alloc_retries']} "
        f"ooms={stats['num_ooms']} peak_reserved={stats['reserved_bytes.all.peak'] / GiB:.1f}"
        f" GiB; {math.ceil(time.monotonic() - start)} s"
    )


if __name__ == "__main__":
    main()
