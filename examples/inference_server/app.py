"""A small inference server that embeds gpumem-exporter: FastAPI and a tiny PyTorch decoder.

From the repository root:

    python -m uvicorn examples.inference_server.app:app --port 8000
    curl -s localhost:8000/generate -H 'content-type: application/json' \\
        -d '{"prompt_tokens": 128, "max_new_tokens": 64, "batch_size": 8}'
    curl -s localhost:9445/metrics | grep -E '^(torch_cuda_reserved_bytes|gpumem_exporter_)'

The model has random weights (nothing is downloaded). It is there to make the CUDA caching
allocator do what a real decoder makes it do: weights that stay, a KV cache allocated for
each request and freed after it, activations at every step. So the exporter has real numbers
to show: allocated bytes go up and down with requests, while reserved bytes stay at the peak.

Environment:
    MODEL_NAME        the `model` label on every series (default: tiny-decoder)
    INFERENCE_DEVICE  auto (CUDA when available, else CPU), cuda, cuda:N or cpu
    POD_NAME, POD_NAMESPACE, NODE_NAME
                      set from the Downward API in Kubernetes; logged and returned in
                      responses, never used as metric labels (Prometheus adds pod and
                      namespace as target labels, and the chart's relabeling adds node)
    GPUMEM_*          read by the exporter itself (GPUMEM_HOST, GPUMEM_PORT, ...)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import exporter
from exporter.config import parse_labels

log = logging.getLogger("inference_server")

MODEL_NAME = os.environ.get("MODEL_NAME", "tiny-decoder")

# Request bounds, 422 beyond them: prompt + new tokens always fit the model's context. The
# largest request takes well under a second on a GPU, but about 20 s on two CPU cores.
MAX_PROMPT_TOKENS = 768
MAX_NEW_TOKENS = 256
MAX_BATCH_SIZE = 32


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 8192
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    max_seq_len: int = 1024  # >= MAX_PROMPT_TOKENS + MAX_NEW_TOKENS


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.dim // config.n_heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, start: int
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head_dim)
        end = start + length
        cache_k[:, :, start:end] = k
        cache_v[:, :, start:end] = v
        # Prefill (start == 0) is causal over the prompt; a decode step (one token) attends to
        # everything cached so far, so it needs no mask.
        y = F.scaled_dot_product_attention(
            q, cache_k[:, :, :end], cache_v[:, :, :end], is_causal=length > 1
        )
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, 4 * config.dim, bias=False),
            nn.GELU(),
            nn.Linear(4 * config.dim, config.dim, bias=False),
        )

    def forward(
        self, x: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, start: int
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache_k, cache_v, start)
        return x + self.mlp(self.mlp_norm(x))


class TinyDecoder(nn.Module):
    """A pre-norm decoder-only transformer with a KV cache, small enough for CPU tests."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(
        self, tokens: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]], start: int
    ) -> torch.Tensor:
        """Logits of the last position only: (batch, vocab)."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block, (cache_k, cache_v) in zip(self.blocks, cache, strict=True):
            x = block(x, cache_k, cache_v, start)
        return self.lm_head(self.norm(x[:, -1]))

    def new_cache(self, batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # One cache per request, sized for it and freed when it ends (as simple servers do;
        # vLLM preallocates one pool instead). Freed blocks stay in PyTorch's cache: that is
        # the reserved-vs-allocated gap the exporter shows.
        config = self.config
        shape = (batch, config.n_heads, length, config.dim // config.n_heads)
        param = self.lm_head.weight
        return [
            (
                torch.empty(shape, device=param.device, dtype=param.dtype),
                torch.empty(shape, device=param.device, dtype=param.dtype),
            )
            for _ in range(config.n_layers)
        ]


@dataclass
class Generation:
    new_tokens: int
    prefill_s: float
    decode_s: float


def _synchronize(device: torch.device) -> None:
    # CUDA kernels run asynchronously: wait for them so that the timings mean something.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(model: TinyDecoder, prompt: torch.Tensor, max_new_tokens: int) -> Generation:
    """Greedy decoding of exactly max_new_tokens tokens (no stop token: steady benchmarks)."""
    device = prompt.device
    batch, prompt_len = prompt.shape
    cache = model.new_cache(batch, prompt_len + max_new_tokens)
    begin = time.perf_counter()
    next_token = model(prompt, cache, 0).argmax(dim=-1, keepdim=True)
    _synchronize(device)
    prefill_end = time.perf_counter()  # time to first token
    for step in range(1, max_new_tokens):
        next_token = model(next_token, cache, prompt_len + step - 1).argmax(dim=-1, keepdim=True)
    _synchronize(device)
    return Generation(max_new_tokens, prefill_end - begin, time.perf_counter() - prefill_end)


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def load_model(device: torch.device) -> TinyDecoder:
    torch.manual_seed(0)  # random weights, but the same ones on every replica
    model = TinyDecoder(ModelConfig())
    # bf16 on GPUs, as inference servers run; CPUs are slow at it, so float32 there.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def exporter_labels() -> dict[str, str]:
    """The `model` label, plus GPUMEM_LABELS (which wins).

    Labels passed to exporter.start() replace GPUMEM_LABELS instead of adding to it, so the
    two are merged here.
    """
    labels = {"model": MODEL_NAME}
    labels.update(parse_labels(os.environ.get("GPUMEM_LABELS", ""), "GPUMEM_LABELS"))
    return labels


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    pod = os.environ.get("POD_NAME", "")
    log.info(
        "model %s on pod %s/%s, node %s",
        MODEL_NAME,
        os.environ.get("POD_NAMESPACE", "-"),
        pod or "-",
        os.environ.get("NODE_NAME", "-"),
    )
    # The exporter gets its own port (GPUMEM_PORT, default 9445) rather than exporter.attach():
    # - /metrics stays off the public API port; the Service exposes only 8000, and Prometheus
    #   scrapes 9445 pod by pod through the PodMonitor;
    # - scrapes and the exporter's /healthz are answered by its own thread, even while this
    #   app's event loop and worker threads are busy with inference;
    # - it registers nothing in prometheus_client's global registry.
    # attach(app) is for servers that already serve /metrics from that registry (vLLM): no
    # second port, and the PodMonitor then scrapes the app's port.
    #
    # Host and port are left to GPUMEM_HOST/GPUMEM_PORT: 127.0.0.1 by default, so running
    # this on a laptop exposes nothing; the Deployment sets GPUMEM_HOST=0.0.0.0.
    #
    # Starting it before the model is loaded is not required: the exporter never initializes
    # CUDA, it only reads devices once this process has a context on them. Starting first
    # lets host memory be watched while the weights load.
    #
    # A bad GPUMEM_* value raises ConfigError here and the server does not start: a
    # deployment mistake worth failing on. Anything else (a taken port, no NVML) is only
    # logged and reported on the handle; inference never depends on the exporter.
    handle = exporter.start(labels=exporter_labels())
    if handle.error:
        log.warning("serving without metrics: %s", handle.error)
    try:
        device = pick_device(os.environ.get("INFERENCE_DEVICE", "auto"))
        app.state.model = load_model(device)
        app.state.device = device
        app.state.pod = pod or None
        app.state.exporter = handle
        # One generation at a time: concurrent requests would only fight for the same device
        # (and, on CPU, the same cores).
        app.state.lock = threading.Lock()
        log.info("model loaded on %s; metrics at %s/metrics", device, handle.url)
        yield
    finally:
        handle.stop()
        log.info("exporter stopped")


app = FastAPI(title="gpumem-exporter example inference server", lifespan=lifespan)


class GenerateRequest(BaseModel):
    # strict: "8" or 8.0 is a 422, not silently an 8; extra keys are a 422, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt_tokens: int = Field(ge=1, le=MAX_PROMPT_TOKENS, description="prompt length")
    max_new_tokens: int = Field(ge=1, le=MAX_NEW_TOKENS, description="tokens to generate")
    batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE, description="sequences in the batch")


class GenerateResponse(BaseModel):
    model: str
    device: str
    dtype: str
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    queue_s: float = Field(description="waiting for the previous request to finish")
    prefill_s: float = Field(description="prompt forward pass: time to first token")
    decode_s: float = Field(description="the other new tokens, one step each")
    total_s: float
    tokens_per_s: float = Field(description="new tokens of the whole batch per second")
    pod: str | None


# A plain `def`: FastAPI runs it in a worker thread, so generation does not block the event
# loop that answers /healthz.
@app.post("/generate")
def generate_endpoint(body: GenerateRequest, request: Request) -> GenerateResponse:
    state = request.app.state
    model: TinyDecoder = state.model
    prompt = torch.randint(
        model.config.vocab_size, (body.batch_size, body.prompt_tokens), device=state.device
    )
    arrived = time.perf_counter()
    with state.lock:
        started = time.perf_counter()
        result = generate(model, prompt, body.max_new_tokens)
    total_s = result.prefill_s + result.decode_s
    return GenerateResponse(
        model=MODEL_NAME,
        device=str(state.device),
        dtype=str(model.lm_head.weight.dtype).removeprefix("torch."),
        batch_size=body.batch_size,
        prompt_tokens=body.prompt_tokens,
        new_tokens=result.new_tokens,
        queue_s=started - arrived,
        prefill_s=result.prefill_s,
        decode_s=result.decode_s,
        total_s=total_s,
        tokens_per_s=body.batch_size * result.new_tokens / total_s if total_s > 0 else 0.0,
        pod=state.pod,
    )


# async: answered on the event loop even while every worker thread is generating. It says
# whether this app works, not whether the exporter does: a broken exporter must not get the
# inference server restarted. The exporter has its own /healthz on its port (503 when its
# samples are stale), watched by the GpuMemExporterStale alert instead.
@app.get("/healthz")
async def healthz(request: Request) -> dict[str, str | None]:
    state = request.app.state
    return {
        "status": "ok",
        "model": MODEL_NAME,
        "device": str(state.device),
        "exporter_url": state.exporter.url,
        "exporter_error": state.exporter.error,
    }
