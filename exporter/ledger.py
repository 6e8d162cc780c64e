"""Where every byte of one process's memory on one GPU goes: the ledger.

Its parts, in this order, each what is left of allocated after the ones before it:

- each component the server named (exporter.components), in the order named;
- `private_pools`: live bytes in private pools (CUDA graphs' and MemPools'), from the layout;
- `other_live`: the rest of allocated (the tensors nobody named);

then `cached_free` (reserved - allocated: PyTorch's cache) and `outside_allocator` (NVML's
per-process used - reserved: CUDA context, NCCL, CuPy, CuMem pools). Their sum is reserved +
outside = NVML's per-process used, exactly, whatever the server named: a component naming more
than is still allocated (its bytes were freed, or it overlaps a private pool) is cut to what is
left, and its own series (torch_cuda_component_bytes) keeps what the server said.
"""

from __future__ import annotations

from exporter.sample import AllocatorReading

PRIVATE_POOLS = "private_pools"
OTHER_LIVE = "other_live"
CACHED_FREE = "cached_free"
OUTSIDE = "outside_allocator"
LEDGER_PARTS = (PRIVATE_POOLS, OTHER_LIVE, CACHED_FREE, OUTSIDE)


def ledger(reading: AllocatorReading) -> list[tuple[str, int]]:
    """(part, bytes) in ledger order; [] where the reading has no allocated or reserved.
    Without a value outside the allocator (NVML off or not listing the process) the sum is
    reserved, and `outside_allocator` is absent rather than 0."""
    allocated = reading.gauges.get("allocated_bytes")
    reserved = reading.gauges.get("reserved_bytes")
    if allocated is None or reserved is None:
        return []
    left = allocated
    parts = []
    for name, nbytes in reading.components.items():
        taken = min(nbytes, left)
        parts.append((name, taken))
        left -= taken
    pools = sum(values.get("allocated_bytes", 0) for values in reading.private_pools.values())
    taken = min(pools, left)
    parts += [(PRIVATE_POOLS, taken), (OTHER_LIVE, left - taken)]
    parts.append((CACHED_FREE, max(reserved - allocated, 0)))
    if reading.non_allocator_bytes is not None:
        parts.append((OUTSIDE, reading.non_allocator_bytes))
    return parts
