"""Private pools' kinds and names (exporter.pools): a pool the server names is of the kind it
was named by, an unnamed one's kind comes from its id, and the names are bounded. The real
allocator's ids: tests/gpu/test_gpu.py (a graph pool and a named MemPool)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exporter.components import ComponentError
from exporter.pools import MAX_NAMES, PoolNames


def test_a_named_mempool_and_a_named_graph_handle_keep_their_kind_and_name():
    pools = PoolNames()
    pools.name(SimpleNamespace(id=(0, 3)), "kv_cache")  # as torch.cuda.MemPool().id
    pools.name((0, 4), "decode_graphs")  # as torch.cuda.graph_pool_handle()
    assert pools.describe("0_3") == {"kind": "mempool", "name": "kv_cache"}
    assert pools.describe("0_4") == {"kind": "graph", "name": "decode_graphs"}


def test_an_unnamed_pools_kind_comes_from_its_id():
    pools = PoolNames()
    assert pools.describe("2_0") == {"kind": "graph", "name": ""}  # a graph's own pool
    assert pools.describe("0_7") == {"kind": "mempool", "name": ""}
    assert pools.describe("other") == {"kind": "", "name": ""}  # pools past the bound


def test_names_past_the_bound_are_counted_not_raised():
    pools = PoolNames()
    for i in range(MAX_NAMES + 5):
        pools.name((0, i + 1), f"pool-{i}")
    assert pools.refused == 5
    assert pools.describe(f"0_{MAX_NAMES + 1}") == {"kind": "mempool", "name": ""}


@pytest.mark.parametrize("pool", ["kv", 3, (1,), SimpleNamespace(id="x")])
def test_what_is_no_pool_is_a_clear_error(pool):
    with pytest.raises(ComponentError, match="not a MemPool or a pool id"):
        PoolNames().name(pool, "kv_cache")


def test_a_bad_name_is_a_clear_error():
    with pytest.raises(ComponentError):
        PoolNames().name((0, 1), "")
