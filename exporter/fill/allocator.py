"""Each process's PyTorch caching allocator: its gauges and counters, pools, layout, OOMs and
their verdicts, the components and ledger of its memory, private pools, its settings; then
its pinned host memory."""

from __future__ import annotations

from collections.abc import Mapping

from exporter import catalog
from exporter.alerts import allocator_settings
from exporter.fill.render import Render
from exporter.fill.rows import FamilyRows, Filled, Labels
from exporter.ledger import ledger
from exporter.sample import AllocatorReading, Sample

# Allocator families in the order /metrics has always listed them (the catalog's order).
_ALLOCATOR = tuple(f for f in catalog.FAMILIES if f.source == "torch" and f.group != "pinned_host")
_GROUPS = tuple(dict.fromkeys(f.group for f in _ALLOCATOR))
_INFO = _ALLOCATOR.index(catalog.family("torch_cuda_allocator"))
# (group, key) of each, in that order: where a render files each new family. In a tuple, not
# a map by Family: a Family's hash is its 13 fields' (dataclass).
_PLACES = tuple((f.group, f.key) for f in _ALLOCATOR)
# Families filled from a reading's attribute of the same name, where it is not None.
_ATTRIBUTE_GROUPS = ("ratio", "non_allocator")
_PINNED_HOST = catalog.group("pinned_host")


def families(render: Render, sample: Sample) -> Filled:
    if not sample.allocators:
        return []
    # One endpoint for several processes (gpumem-exporter run): label each by process.
    per_process = any(reading.process for reading in sample.allocators)
    families = render.plans.new_each(_ALLOCATOR, per_process)
    by_key: dict[str, dict[str, FamilyRows]] = {group: {} for group in _GROUPS}
    for (group, key), filling in zip(_PLACES, families, strict=True):
        by_key[group][key] = filling
    info = families[_INFO]
    for reading in sample.allocators:
        ids = Labels(
            render.processes.labels(reading.process),
            device=reading.device,
            gpu_uuid=reading.gpu_uuid,
        )
        _add_reading(by_key, reading, ids)
        info.add_info(
            ids,
            {
                **allocator_settings(reading),  # as the settings-change alert compares them
                "settings_source": reading.settings.get("source", "environment"),
                "torch_version": render.about.torch_version,
            },
        )
    # A list, not a generator: the allocator's ~40 families each passed up through nested
    # generators were a fifth of this group's render.
    found = [(filling, False) for filling in families]
    found += _pinned_host(render, sample)
    return found


def _add_reading(
    by_key: dict[str, dict[str, FamilyRows]], reading: AllocatorReading, ids: Labels
) -> None:
    for key, value in reading.gauges.items():
        by_key["allocator_gauge"][key].add(ids, value)
    for key, value in reading.counters.items():
        by_key["allocator_counter"][key].add(ids, value)
    for pool, pool_gauges in sorted(reading.pools.items()):
        pool_ids = Labels(ids, pool=pool)
        for key, value in pool_gauges.items():
            by_key["pool"][key].add(pool_ids, value)
    for group in _ATTRIBUTE_GROUPS:
        for key, filling in by_key[group].items():
            if (value := getattr(reading, key)) is not None:
                filling.add(ids, value)
    for key, value in reading.layout.items():
        by_key["layout"][key].add(ids, value)
    if reading.layout_age_s is not None:
        by_key["layout_state"]["layout_age_s"].add(ids, reading.layout_age_s)
    if reading.layout_skipped:
        skipped = by_key["layout_state"]["layout_skipped"]
        skipped.add_info(ids, {"reason": reading.layout_skipped})
    _add_oom(by_key["oom"], reading, ids)
    for name, nbytes in reading.components.items():
        by_key["component"]["components"].add({**ids, "component": name}, nbytes)
    for part, nbytes in ledger(reading):
        by_key["ledger"]["ledger"].add({**ids, "component": part}, nbytes)
    for pool_id, pool_gauges in sorted(reading.private_pools.items()):
        pool_ids = Labels(ids, pool_id=pool_id)
        for key, value in pool_gauges.items():
            by_key["private_pool"][key].add(pool_ids, value)
    for pool_id, described in sorted(reading.private_pool_info.items()):
        by_key["private_pool_info"]["private_pool_info"].add_info(
            Labels(ids, pool_id=pool_id), described
        )


def _add_oom(
    families: Mapping[str, FamilyRows], reading: AllocatorReading, ids: Mapping[str, object]
) -> None:
    for verdict, count in sorted(reading.ooms_by_verdict.items()):
        families["ooms_by_verdict"].add({**ids, "verdict": verdict}, count)
    last = reading.last_oom
    if last is None:
        return
    families["last_timestamp"].add({**ids, "verdict": last.verdict}, last.timestamp)
    for name, value in last.deciding_bytes().items():
        families["last_bytes"].add({**ids, "reading": name}, value)


def _pinned_host(render: Render, sample: Sample) -> Filled:
    if not sample.pinned_host:
        return []
    per_process = any(reading.process for reading in sample.pinned_host)
    found: Filled = []
    for entry in _PINNED_HOST:
        family = render.plans.new(entry, per_process)
        for reading in sample.pinned_host:
            family.add(render.processes.labels(reading.process), getattr(reading, entry.key))
        found.append((family, True))
    return found
