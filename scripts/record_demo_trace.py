"""Record the demo trace on a real GPU: an inference-like workload that ends in an incident.

Run on a machine with a CUDA GPU, from the repository root:

    python3 scripts/record_demo_trace.py --out exporter/data/demo_trace.jsonl.gz \
        --snapshot exporter/data/demo_snapshot.pickle.gz

The exporter's real sources (allocator, NVML, host) are sampled by the real sampler every
0.5 s (the allocator's layout, from a snapshot, every 2 s) while the main thread runs, in
phases:

1. startup (0-10 s): as vLLM does before it serves, decode steps for batch sizes 1-64 are
   captured into CUDA graphs sharing one private pool (replayed between requests from then
   on), and a 4 GiB pinned-host "swap space" is allocated.
2. serving (10-60 s): a bf16 decoder (12 layers, hidden 4096, ~4.8 GiB of weights) generates
   token by token for request batches of varied batch size, prompt and output length; the KV
   cache grows by torch.cat every 16 tokens, as naive servers do; now and then a KV block is
   swapped out to the pinned space and back (non-blocking copies).
3. fragmentation (60-100 s): a "prefix cache" keeps every other block of varied sizes alive,
   so partly used segments pile up, inactive_split / reserved climbs and the largest free
   block falls far below the free cache. History is recorded only in its last 5 s (while it
   is on, the exporter does not take layout snapshots).
4. pressure (100-130 s): traffic goes on under a 20 GiB cap
   (torch.cuda.set_per_process_memory_fraction), so large KV allocations first flush the
   cache and retry, and finally one request runs out of memory (caught, as a server would).
5. recovery (130-145 s): the prefix cache and the swap space are dropped, empty_cache()
   returns the cache to the driver, traffic resumes (the pinned memory stays cached).
6. expandable (145-175 s): the allocator is switched to expandable_segments:True at run time
   and a smaller prefix cache fragments it again: inactive_split is not tracked there, the
   free bytes inside used segments still are.

A snapshot of the allocator (with allocation history recorded at the end of the
fragmentation phase) is also written for the incident tools' demo.
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
PHASES = (
    ("startup", 10.0),
    ("serving", 50.0),
    ("fragmentation", 40.0),
    ("pressure", 30.0),
    ("recovery", 15.0),
    ("expandable", 30.0),
)
GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64)
SWAP_BYTES = 4 * GiB
HISTORY_LAST_S = 5.0
LAYOUT_INTERVAL_S = 2.0


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


class GraphedSteps:
    """Decode steps captured as CUDA graphs per batch size, all in one private pool."""

    def __init__(self, decoder: Decoder) -> None:
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.decoder = decoder
        pool = None
        side = torch.cuda.Stream(device=decoder.device)
        for batch in GRAPH_BATCHES:
            static = torch.zeros(batch, 1, HIDDEN, device=decoder.device, dtype=torch.bfloat16)
            side.wait_stream(torch.cuda.current_stream(decoder.device))
            with torch.cuda.stream(side):
                self._step(static)  # warm-up outside the capture, as CUDA graphs require
            torch.cuda.current_stream(decoder.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(static)
            pool = graph.pool()
            self.graphs[batch] = (graph, static)
        self.pool_id = pool

    def _step(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.decoder.layers:
            x = torch.nn.functional.silu((x @ layer["o"]) @ layer["up"][:, :FFN]) @ layer["down"]
        return x

    def replay(self, rng: random.Random) -> str:
        batch = rng.choice(GRAPH_BATCHES)
        graph, _ = self.graphs[batch]
        for _ in range(8):
            graph.replay()
        torch.cuda.synchronize(self.decoder.device)
        return f"graph replay batch={batch}"


def fragment(
    device: torch.device, cache: list[torch.Tensor], state: dict[str, float], target: float
) -> None:
    """Rounds of blocks, each round's blocks 7% larger than the last round's. Every other
    block stays alive, so each round leaves holes that later, larger requests cannot use:
    free space piles up inside partly used segments and inactive_split / reserved climbs, as
    with a prefix cache of odd sizes."""
    while state["bytes"] < target:
        size = int(state["size"])
        count = max(2, FRAG_ROUND_BYTES // size)
        batch = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
        cache.extend(batch[::2])
        state["bytes"] += size * count
        state["size"] *= 1.07
        del batch


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
        "batches with CUDA graphs and pinned swap space, then fragmentation, allocation "
        f"retries, an OOM, recovery under a {CAP_BYTES // GiB} GiB cap, and expandable "
        "segments switched on at run time",
        "device_name": torch.cuda.get_device_name(device),
        "torch_version": torch.__version__,
        "host": socket.gethostname(),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cap_bytes": CAP_BYTES,
        "interval_s": args.interval_s,
        "layout_interval_s": LAYOUT_INTERVAL_S,
        "phases": [{"name": n, "duration_s": d} for n, d in PHASES],
        "script": "scripts/record_demo_trace.py",
    }
    writer = TraceWriter(args.out, meta=meta)
    sampler = Sampler(
        [
            TorchAllocatorSource(layout_interval_s=LAYOUT_INTERVAL_S),
            NvmlSource(),
            HostMemorySource(),
        ],
        interval_s=args.interval_s,
        listeners=[writer],
    )
    decoder = Decoder(device)
    torch.cuda.synchronize()
    sampler.start()
    prefix_cache: list[torch.Tensor] = []
    frag = {"bytes": 0.0, "size": float(1 << 20)}
    frag_rounds = 0
    switched = False
    graphs: GraphedSteps | None = None
    swap: list[torch.Tensor] = []
    start = time.monotonic()
    events = []

    def log(message: str) -> None:
        line = f"{time.monotonic() - start:7.1f}s {message}"
        events.append(line)
        print(line, flush=True)

    def traffic(scale: float = 1.0) -> None:
        log(serve_one(decoder, rng, scale))
        if graphs is not None:
            log(graphs.replay(rng))

    for phase, duration in PHASES:
        log(f"phase {phase}")
        phase_start = time.monotonic()
        phase_end = phase_start + duration
        history = False
        while time.monotonic() < phase_end:
            if phase == "startup":
                if graphs is None:
                    graphs = GraphedSteps(decoder)
                    log(f"captured {len(graphs.graphs)} CUDA graphs in pool {graphs.pool_id}")
                    swap = [
                        torch.empty(SWAP_BYTES // 4, dtype=torch.uint8, pin_memory=True)
                        for _ in range(4)
                    ]
                    log(f"pinned swap space {SWAP_BYTES / GiB:.0f} GiB")
                traffic()
            elif phase == "serving":
                if rng.random() < 0.2:
                    # Swap a KV-sized block out and back in, as servers do under pressure.
                    block = torch.empty(SWAP_BYTES // 8, dtype=torch.uint8, device=device)
                    host = swap[rng.randrange(4)][: block.numel()]
                    host.copy_(block, non_blocking=True)
                    block.copy_(host, non_blocking=True)
                    torch.cuda.synchronize(device)
                    del block
                    log("swapped a 512 MiB block out and in")
                traffic()
            elif phase in ("fragmentation", "expandable"):
                if phase == "expandable" and not switched:
                    # Applies to segments made from now on (the weights keep theirs).
                    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
                    log("allocator switched to expandable_segments:True")
                    frag = {"bytes": 0.0, "size": float(1 << 20)}
                    switched = True
                if (
                    phase == "fragmentation"
                    and not history
                    and phase_end - time.monotonic() < HISTORY_LAST_S
                ):
                    torch.cuda.memory._record_memory_history(max_entries=20000, stacks="python")
                    history = True
                share = 0.4 if phase == "expandable" else 1.0
                progress = min((time.monotonic() - phase_start) / duration, 1.0)
                fragment(device, prefix_cache, frag, FRAG_TARGET_BYTES * share * progress)
                frag_rounds += 1
                if frag_rounds % 4 == 0:
                    stats = torch.cuda.memory_stats_as_nested_dict(device)
                    inactive = stats["inactive_split_bytes"]["all"]["current"]
                    reserved = stats["reserved_bytes"]["all"]["current"]
                    log(f"inactive_split {inactive / reserved:.2f} of {reserved / GiB:.1f} GiB")
                    traffic(scale=0.25)
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
                traffic()
                if phase_end - time.monotonic() < 8 and not any("OOM" in e for e in events):
                    try:  # the request that no cache flush can satisfy
                        huge = torch.empty(CAP_BYTES, dtype=torch.uint8, device=device)
                        del huge
                    except torch.cuda.OutOfMemoryError:
                        log("OOM on a request for the whole cap (shed)")
            else:  # recovery
                if prefix_cache or swap:
                    prefix_cache.clear()
                    swap.clear()
                    torch.cuda.empty_cache()
                    log("prefix cache and swap space dropped, empty_cache()")
                traffic()
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
