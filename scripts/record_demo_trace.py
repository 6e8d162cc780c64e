"""Record the demo on a real GPU: an LLM inference server that runs out of memory under a cap.

Run on a machine with a CUDA GPU, from the repository root:

    python3 scripts/record_demo_trace.py --out exporter/data/demo_trace.jsonl.gz \
        --snapshots exporter/data/demo_snapshots

The workload is a real one, with random weights: a Llama-shaped bf16 decoder (16 layers,
hidden 4096, SwiGLU 11008, 32 heads, vocabulary 32000: 3.5 B parameters, 6.5 GiB) serves a
stream of generation requests, as TGI and transformers pipelines do:

- waiting requests are batched first come, first served, up to a budget of cache tokens;
- a batch is generated as transformers' generate() with its dynamic cache does it: prompts
  padded on the left, one key and one value tensor per layer grown by torch.cat on every
  token, so caches of many sizes are made and freed and the allocator's segments fill with
  holes;
- the decode step runs as piecewise CUDA graphs (vLLM's default): everything but attention
  is captured per layer for padded batch sizes 1-32, in one private pool;
- generated tokens leave through pinned host memory;
- the server names its memory for the ledger, as a server embedding the exporter would: the
  weights with exporter.component("weights"), the live key/value cache's size with
  exporter.set_component("kv_cache", ...) at every step, and its graphs' private pool with
  exporter.name_pool(pool, "decode_graphs");
- the process runs under a memory cap (torch.cuda.set_per_process_memory_fraction) and the
  server's first token budget is too big for it: a batch of long documents makes the
  allocator flush its cache and retry, and when that fails the server catches the OOM,
  splits the batch, shrinks its budget and goes on.

The load has phases: light traffic, steady traffic, a burst of long-document requests
(fragmentation, retries and OOMs), then steady traffic again.

The exporter records itself, as a user would: exporter.start() with a trace writer as a
listener (every 0.5 s, the layout every 2 s) and a snapshot on OOM (at most one per 20 s).
Through the admin API (the admin client, from a thread of its own) a snapshot is asked for
every 15 s, and twice a windowed capture records allocation history with Python stacks (one
while healthy, one over the burst of long documents). The snapshots are copied next to the
trace, named by the second of the trace they were taken at; the demo serves the one of the
moment it replays.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import queue
import random
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import exporter
from exporter.client import AdminClient
from exporter.trace import TraceWriter

GiB = 1 << 30
LAYERS, HIDDEN, FFN, HEADS, VOCAB = 16, 4096, 11008, 32, 32000
HEAD_DIM = HIDDEN // HEADS
GRAPH_BATCHES = (1, 2, 4, 8, 16, 24, 32)
MAX_BATCH = 32
CAP_BYTES = 22 * GiB
# The server's first guess of how many cache tokens (batch x longest request) fit: too
# many for the cap, as first guesses are.
TOKEN_BUDGET = 96 * 1024
SNAPSHOT_EVERY_S = 15.0
# (phase, seconds, requests per second, prompt tokens (low, high), new tokens (low, high))
PHASES = (
    ("light", 20.0, 0.3, (64, 1024), (32, 256)),
    ("steady", 40.0, 0.8, (128, 2048), (64, 384)),
    ("long documents", 50.0, 0.6, (2048, 8192), (128, 512)),
    ("steady again", 40.0, 0.8, (128, 2048), (64, 384)),
)
# Windowed captures (POST /snapshot with record_s): allocation history with Python stacks
# for this many seconds from this many seconds into the named phase. While history records,
# the exporter reads no layout (docs/metrics.md), as in production.
CAPTURES = (("steady", 12.0, 25.0), ("long documents", 0.0, 30.0))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight)


class Model:
    """Random bf16 weights in the shapes of a Llama decoder."""

    def __init__(self, device: torch.device) -> None:
        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02

        self.device = device
        self.embed = w(VOCAB, HIDDEN)
        self.head = w(HIDDEN, VOCAB)
        self.norm = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
        self.layers = [
            {
                "attn_norm": torch.ones(HIDDEN, device=device, dtype=torch.bfloat16),
                "qkv": w(HIDDEN, 3 * HIDDEN),
                "o": w(HIDDEN, HIDDEN),
                "mlp_norm": torch.ones(HIDDEN, device=device, dtype=torch.bfloat16),
                "gate_up": w(HIDDEN, 2 * FFN),
                "down": w(FFN, HIDDEN),
            }
            for _ in range(LAYERS)
        ]

    def pre_attention(self, i: int, x: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        return rms_norm(x, layer["attn_norm"]) @ layer["qkv"]

    def post_attention(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        x = x + attn @ layer["o"]
        gate, up = (rms_norm(x, layer["mlp_norm"]) @ layer["gate_up"]).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ layer["down"]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm) @ self.head


@dataclass
class Request:
    id: int
    prompt: int
    new_tokens: int
    arrived: float


class Engine:
    """Generation for a batch of requests, as transformers' generate() with its dynamic
    cache does it: prompts padded on the left, one key and one value tensor per layer for
    the whole batch, grown by torch.cat on every token; piecewise CUDA graphs (vLLM's
    default) run everything but attention, per padded batch size, in one private pool."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.device = model.device
        self.graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]]] = {}
        self.static: dict[int, dict[str, torch.Tensor]] = {}
        self.pool: object = None
        # Generated tokens leave the GPU through pinned host memory (the caching host
        # allocator keeps those pages), as servers stream tokens to clients.
        self.tokens_out = torch.empty(MAX_BATCH, dtype=torch.int64, pin_memory=True)

    def capture(self) -> None:
        side = torch.cuda.Stream(self.device)
        for batch in GRAPH_BATCHES:
            static = {
                "x": torch.zeros(batch, 1, HIDDEN, device=self.device, dtype=torch.bfloat16),
                "qkv": torch.zeros(batch, 1, 3 * HIDDEN, device=self.device, dtype=torch.bfloat16),
                "attn": torch.zeros(batch, 1, HIDDEN, device=self.device, dtype=torch.bfloat16),
            }
            pieces = []
            for i in range(LAYERS):
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # warm-up outside the capture
                    self.model.pre_attention(i, static["x"])
                    self.model.post_attention(i, static["x"], static["attn"])
                torch.cuda.current_stream(self.device).wait_stream(side)
                pre, post = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(pre, pool=self.pool):
                    static["qkv"].copy_(self.model.pre_attention(i, static["x"]))
                self.pool = pre.pool()
                with torch.cuda.graph(post, pool=self.pool):
                    static["x"].copy_(self.model.post_attention(i, static["x"], static["attn"]))
                pieces.append((pre, post))
            self.graphs[batch] = pieces
            self.static[batch] = static

    def generate(self, batch: list[Request], rng: random.Random) -> None:
        n = len(batch)
        width = max(r.prompt for r in batch)
        steps = max(r.new_tokens for r in batch)
        tokens = torch.randint(0, VOCAB, (n, width), device=self.device)
        # Left padding: position j of row r is padding when j < width - prompt(r).
        pad = torch.tensor([width - r.prompt for r in batch], device=self.device)
        keep = torch.arange(width, device=self.device)[None, :] >= pad[:, None]  # (n, width)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        mask = (causal[None, None] & keep[:, None, None, :]) | ~keep[:, None, :, None]
        x = self.model.embed[tokens]  # (n, width, HIDDEN)
        keys, values = [], []
        for i in range(LAYERS):
            q, k, v = heads_of(self.model.pre_attention(i, x))  # (n, HEADS, width, D)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            keys.append(k)
            values.append(v)
            x = self.model.post_attention(i, x, attn.transpose(1, 2).reshape(n, width, HIDDEN))
        del mask, causal
        exporter.set_component("kv_cache", cache_bytes(keys, values), self.device.index or 0)
        token = self.model.logits(x[:, -1:]).argmax(dim=-1)  # (n, 1)
        del x
        size = next(b for b in GRAPH_BATCHES if b >= n)
        static, pieces = self.static[size], self.graphs[size]
        for _ in range(steps):
            static["x"][:n].copy_(self.model.embed[token])
            keep = torch.cat([keep, keep.new_ones(n, 1)], dim=1)
            for i, (pre, post) in enumerate(pieces):
                pre.replay()
                q, k, v = heads_of(static["qkv"][:n])
                keys[i] = torch.cat([keys[i], k], dim=2)  # the cache grows by one token
                values[i] = torch.cat([values[i], v], dim=2)
                attn = F.scaled_dot_product_attention(
                    q, keys[i], values[i], attn_mask=keep[:, None, None, :]
                )
                static["attn"][:n].copy_(attn.transpose(1, 2).reshape(n, 1, HIDDEN))
                post.replay()
            token = self.model.logits(static["x"][:n]).argmax(dim=-1)
            self.tokens_out[:n].copy_(token[:, 0], non_blocking=True)
            exporter.set_component("kv_cache", cache_bytes(keys, values), self.device.index or 0)
        torch.cuda.synchronize(self.device)


def cache_bytes(keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in (*keys, *values))


def heads_of(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, tokens, 3 HIDDEN) -> q, k, v as (n, HEADS, tokens, HEAD_DIM)."""
    n, tokens, _ = qkv.shape
    q, k, v = qkv.view(n, tokens, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


class Server:
    """Dynamic batching, as TGI and transformers pipelines serve: the waiting requests are
    batched first come, first served, up to a budget of cache tokens (batch x longest
    prompt and output); a batch that runs out of memory is split in two and retried, and
    the budget shrinks (the server learns its limit the hard way)."""

    def __init__(self, engine: Engine, rng: random.Random, log: Callable[[str], None]) -> None:
        self.engine = engine
        self.rng = rng
        self.log = log
        self.waiting: list[Request] = []
        self.finished = 0
        self.ooms = 0
        self.budget = TOKEN_BUDGET
        self.next_id = 0

    def arrive(self, prompt: tuple[int, int], new: tuple[int, int]) -> None:
        request = Request(
            self.next_id, self.rng.randint(*prompt), self.rng.randint(*new), time.monotonic()
        )
        self.waiting.append(request)
        self.next_id += 1

    def step(self) -> None:
        batch: list[Request] = []
        for request in self.waiting:
            widest = max(
                [r.prompt + r.new_tokens for r in batch] + [request.prompt + request.new_tokens]
            )
            if batch and (len(batch) == MAX_BATCH or (len(batch) + 1) * widest > self.budget):
                break
            batch.append(request)
        if not batch:
            return
        del self.waiting[: len(batch)]
        try:
            self.engine.generate(batch, self.rng)
            self.finished += len(batch)
        except torch.cuda.OutOfMemoryError:
            # The batch's cache is freed with the exception's frames.
            self.ooms += 1
            tokens = len(batch) * max(r.prompt + r.new_tokens for r in batch)
            self.budget = max(int(min(self.budget, tokens) * 0.8), 4096)
            half = max(len(batch) // 2, 1)
            self.waiting[:0] = batch  # retried first, in two batches
            if len(batch) == 1:
                self.waiting.pop(0)  # a single request that cannot fit is refused
            self.log(
                f"OOM: batch of {len(batch)} ({tokens} cache tokens) split in {half}s; "
                f"budget now {self.budget} tokens"
            )
        finally:
            # Between batches the server holds no cache.
            exporter.set_component("kv_cache", 0, self.engine.device.index or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("exporter/data/demo_trace.jsonl.gz"))
    parser.add_argument("--snapshots", type=Path, default=Path("exporter/data/demo_snapshots"))
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--scale", type=float, default=1.0, help="phase durations times this")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total, device)
    name = torch.cuda.get_device_name(device)
    phases = [(p, d * args.scale, *rest) for p, d, *rest in PHASES]
    meta = {
        "description": f"{name}: a Llama-shaped bf16 decoder (3.5 B parameters, random weights) "
        "serving generation requests with continuous batching, piecewise CUDA graphs and a "
        f"pinned swap space under a {CAP_BYTES // GiB} GiB memory cap, its weights, key/value "
        "cache and graph pool named for the memory ledger; a burst of long "
        "documents fragments its cache, makes it retry allocations and run out of memory, and "
        "it preempts requests to go on",
        "device_name": name,
        "torch_version": torch.__version__,
        "host": socket.gethostname(),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cap_bytes": CAP_BYTES,
        "interval_s": args.interval_s,
        "layout_interval_s": 2.0,
        "phases": [{"name": p, "duration_s": d} for p, d, *_ in phases],
        "script": "scripts/record_demo_trace.py",
    }
    snapshot_dir = Path(tempfile.mkdtemp(prefix="demo-snapshots-"))
    token = secrets.token_hex(16)
    writer = TraceWriter(args.out, meta=meta)
    handle = exporter.start(
        port=0,
        interval_s=args.interval_s,
        layout_interval_s=2.0,
        listeners=[writer],
        oom_snapshot=True,
        oom_snapshot_cooldown_s=20.0,
        snapshot_dir=str(snapshot_dir),
        admin_token=token,
    )
    admin = AdminClient(handle.url, token, timeout_s=120)
    start = time.monotonic()

    def log(message: str) -> None:
        print(f"{time.monotonic() - start:7.1f}s {message}", flush=True)

    with exporter.component("weights"):
        model = Model(device)
    engine = Engine(model)
    engine.capture()
    exporter.name_pool(engine.pool, "decode_graphs")
    log(f"weights and {len(GRAPH_BATCHES) * LAYERS * 2} CUDA graphs ready")
    server = Server(engine, rng, log)
    snapshots = Snapshots(admin, log)
    for phase, duration, rate, prompt, new in phases:
        log(f"phase {phase}")
        snapshots.phase(phase)
        end = time.monotonic() + duration
        next_arrival = time.monotonic()
        while time.monotonic() < end:
            while time.monotonic() >= next_arrival:
                server.arrive(prompt, new)
                next_arrival += rng.expovariate(rate)
            if server.waiting:
                server.step()
            else:
                time.sleep(0.01)
        stats = torch.cuda.memory_stats(device)
        log(
            f"end of {phase}: {server.finished} finished, {len(server.waiting)} waiting, "
            f"retries={stats['num_alloc_retries']} ooms={stats['num_ooms']}"
        )
    snapshots.stop()
    handle.stop()
    writer.close()
    trace_start = _first_timestamp(args.out)
    _copy_snapshots(snapshot_dir, args.snapshots, trace_start)
    shutil.rmtree(snapshot_dir, ignore_errors=True)
    stats = torch.cuda.memory_stats(device)
    print(
        f"wrote {writer.count} samples to {args.out}; retries={stats['num_alloc_retries']} "
        f"ooms={stats['num_ooms']} budget={server.budget} "
        f"peak_reserved={stats['reserved_bytes.all.peak'] / GiB:.1f} GiB; "
        f"{math.ceil(time.monotonic() - start)} s"
    )


class Snapshots:
    """Asks the exporter for snapshots through its admin API, as an on-call would, from a
    thread of its own (a windowed capture's answer waits for the window): every
    SNAPSHOT_EVERY_S, and the windowed CAPTURES."""

    def __init__(self, admin: AdminClient, log: Callable[[str], None]) -> None:
        self.admin = admin
        self.log = log
        self.windows: queue.Queue[tuple[float, float]] = queue.Queue()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def phase(self, name: str) -> None:
        for phase, after_s, record_s in CAPTURES:
            if phase == name:
                self.windows.put((time.monotonic() + after_s, record_s))

    def _run(self) -> None:
        next_plain = time.monotonic() + SNAPSHOT_EVERY_S
        window: tuple[float, float] | None = None
        while not self.done.wait(0.2):
            if window is None and not self.windows.empty():
                window = self.windows.get()
            if window is not None and time.monotonic() >= window[0]:
                self._take(window[1])
                window = None
            elif time.monotonic() >= next_plain:
                self._take(None)
                next_plain = time.monotonic() + SNAPSHOT_EVERY_S

    def _take(self, record_s: float | None) -> None:
        answer = self.admin.snapshot(record_s=record_s)
        ids = [(p.get("result") or {}).get("id") for p in answer["processes"]]
        self.log(f"snapshot{f' of a {record_s:.0f} s window' if record_s else ''}: {ids}")

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def _first_timestamp(trace: Path) -> float:
    with gzip.open(trace, "rt") as f:
        f.readline()
        return float(json.loads(f.readline())["timestamp"])


def _copy_snapshots(source: Path, target: Path, trace_start: float) -> None:
    """The store's snapshots, named by the second of the trace they were taken at, and an
    index the demo reads (exporter/actions/replay.py)."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    index = []
    for sidecar in sorted(source.glob("*.json")):
        info = json.loads(sidecar.read_text())
        if info.get("status") != "ready":
            continue
        # The moment the snapshot shows: when it was written (a windowed capture's entry is
        # created when its window opens).
        offset = round((source / info["filename"]).stat().st_mtime - trace_start, 1)
        name = f"{offset:07.1f}-{info['trigger']}.pickle.gz"
        data = (source / info["filename"]).read_bytes()
        compressed = data[:2] == b"\x1f\x8b"
        (target / name).write_bytes(data if compressed else gzip.compress(data, 9))
        index.append({"file": name, "offset_s": offset, "trigger": info["trigger"]})
        print(f"snapshot {name}: {(target / name).stat().st_size >> 10} KiB")
    (target / "index.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
