"""What each private pool of the allocator is: its kind and, where the server says, its name.

    pool = torch.cuda.MemPool()
    exporter.name_pool(pool, "kv_cache")                  # kind "mempool"
    exporter.name_pool(torch.cuda.graph_pool_handle(), "decode_graphs")   # kind "graph"

The allocator knows pools only by id. A pool the server names is of the kind it was named by:
a `torch.cuda.MemPool` is a `mempool`, a pool handle (the id tuple `graph_pool_handle()` gives,
or any id) is a `graph` pool. An unnamed pool's kind comes from its id: a CUDA graph captured
without a pool of its own gets (capture id, 0), so `N_0` with N > 0 is `graph`; every pool a
server made (`MemPool()`, `graph_pool_handle()`) gets (0, N), so `0_N` is `mempool`, a shared
graph pool among them until the server names it. Served as torch_cuda_private_pool_info.

Bounded: at most MAX_NAMES names per process (ids are never reused, so a name for a pool that
was deleted matches nothing again and only holds its place); further names are not taken,
counted (`refused`, gpumem_exporter_component_problems{problem="pools_refused"}) and said once
in the log, never raised into the server. Standard library only: agents import this.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from exporter.components import ComponentError, check_name

log = logging.getLogger("exporter")

MAX_NAMES = 64
GRAPH, MEMPOOL = "graph", "mempool"
POOL_KINDS = (GRAPH, MEMPOOL, "")  # "": "other", the pools past the bound summed


def pool_id_of(pool: Any) -> tuple[tuple[int, int], str]:
    """The id of a MemPool (kind mempool) or a pool handle (kind graph), as the allocator
    keys its pools; ComponentError for anything else."""
    is_mempool = hasattr(pool, "id")
    found = pool.id if is_mempool else pool
    try:
        first, second = (int(part) for part in found)
    except (TypeError, ValueError):
        raise ComponentError(f"not a MemPool or a pool id: {pool!r:.80}") from None
    return (first, second), MEMPOOL if is_mempool else GRAPH


class PoolNames:
    """The names the server gave its pools; any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._named: dict[str, tuple[str, str]] = {}  # pool label -> (kind, name)
        self.refused = 0

    def name(self, pool: Any, name: str) -> None:
        (first, second), kind = pool_id_of(pool)
        name = check_name(name)
        label = f"{first}_{second}"
        with self._lock:
            if label not in self._named and len(self._named) >= MAX_NAMES:
                self.refused += 1
                if self.refused == 1:
                    log.warning(
                        "gpumem-exporter: more than %d named pools; %r not named", MAX_NAMES, name
                    )
                return
            self._named[label] = (kind, name)

    def names(self) -> dict[str, str]:
        """Pool label -> the name the server gave it (a snapshot's sidecar keeps them)."""
        with self._lock:
            return {label: name for label, (_, name) in self._named.items()}

    def describe(self, label: str) -> dict[str, str]:
        """{"kind", "name"} of one pool label ("other" sums pools beyond the bound)."""
        with self._lock:
            named = self._named.get(label)
        if named is not None:
            return {"kind": named[0], "name": named[1]}
        first, _, second = label.partition("_")
        if label == "other" or not (first.isdigit() and second.isdigit()):
            return {"kind": "", "name": ""}
        kind = GRAPH if int(first) > 0 and int(second) == 0 else MEMPOOL
        return {"kind": kind, "name": ""}


@functools.cache
def registry() -> PoolNames:
    """This process's pool names (one per process)."""
    return PoolNames()


def name_pool(pool: Any, name: str) -> None:
    """Name a private pool (a torch.cuda.MemPool, or a pool id such as graph_pool_handle()'s)."""
    registry().name(pool, name)
