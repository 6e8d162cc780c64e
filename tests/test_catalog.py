"""The metric catalog (exporter/catalog.py) is the one list of families: the collector serves
only what it declares, as it declares it, serves every family it declares in some mode, and
docs/metrics.md carries its table."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter import catalog, reference
from exporter.catalog import PROCESS_LABELS
from exporter.modes import MODES
from exporter.sample import Sample
from exporter.sources.replay import demo_trace_path
from exporter.trace import read_trace
from exporter.window import FIELDS
from tests.helpers import (
    CLIENT_PYTHON,
    catalog_collector,
    every_family_cases,
    node_shaped,
    run_shaped,
)

_BY_EXPOSED = {f.exposed: f for f in catalog.FAMILIES}


def _exposition(
    sample: Sample, mode: str, const: dict[str, str], per_process: bool, detail: str = "full"
) -> str:
    registry = CollectorRegistry()
    registry.register(catalog_collector(sample, mode, const, per_process, detail))
    return generate_latest(registry).decode()


def _expositions() -> list[tuple[str, bool, str]]:
    """(mode, per_process, text) over real readings (tests.helpers.every_family_cases)."""
    return [
        (mode, per_process, _exposition(sample, mode, const, per_process))
        for mode, per_process, const, sample in every_family_cases()
    ]


@pytest.mark.slow
def test_every_family_served_is_declared_with_its_type_and_labels() -> None:
    served: set[str] = set()
    for mode, per_process, text in _expositions():
        for family in text_string_to_metric_families(text):
            if CLIENT_PYTHON.match(family.name):
                continue
            # The text format shows an info family as a gauge named <name>_info.
            entry = _BY_EXPOSED.get(family.name) or catalog.family(family.name)
            assert entry.served(MODES[mode].traits.has), f"{entry.name} served in {mode}"
            assert family.type == ("gauge" if entry.kind == "info" else entry.kind), entry.name
            allowed = {"rank", *entry.labels, *entry.info_labels}
            if per_process and entry.per_process:
                allowed |= set(PROCESS_LABELS)
            for sample in family.samples:
                assert set(sample.labels) <= allowed, (entry.name, sample.labels)
            served.add(entry.name)
    never = [f.name for f in catalog.FAMILIES if f.name not in served]
    assert never == [], f"declared but never served: {never}"


def test_docs_tables_are_the_code() -> None:
    """docs/metrics.md's families and docs/settings.md's settings are written from the
    declarations; an edit to either side alone fails here."""
    assert reference.stale() == [], "run `python -m exporter.reference --write`"


def _expand(name: str) -> list[str]:
    """`torch_cuda_pool_{allocated,reserved}_bytes` -> both names."""
    match = re.search(r"\{([^}]*)\}", name)
    if not match:
        return [name]
    return [
        expanded
        for part in match.group(1).split(",")
        for expanded in _expand(name[: match.start()] + part + name[match.end() :])
    ]


def test_every_family_the_docs_name_is_declared() -> None:
    """A family renamed or removed in the catalog cannot live on in the docs' prose."""
    exposed = {f.exposed for f in catalog.FAMILIES} | {f.name for f in catalog.FAMILIES}
    exposed |= {label for f in catalog.FAMILIES for label in f.labels}  # gpu_uuid
    text = (reference.DOCS / "metrics.md").read_text()
    named = re.findall(r"`((?:torch_cuda|gpumem_exporter|gpu|host)_[a-z_{},]+)`", text)
    # A trailing {...} lists labels; one inside the name lists variants.
    names = [re.sub(r"\{[^}]*\}$", "", name) for name in named]
    unknown = sorted({n for name in names for n in _expand(name) if n not in exposed})
    assert unknown == []


def test_the_live_page_draws_declared_values() -> None:
    """Each per-GPU series of the live page is a declared family's value, or derived from
    declared ones (named here)."""
    keys = {f.key for f in catalog.FAMILIES if f.key}
    derived = {"cached_free_bytes", "other_bytes"}
    assert [f for f in FIELDS if f not in keys | derived] == []


def test_families_need_what_modes_have_and_every_need_is_had() -> None:
    """A family names what it needs (catalog.NEEDS), never a mode; the modes declare what
    they have: every need is some mode's, and every family is served by some mode."""
    had = set().union(*(m.traits.has for m in MODES.values()))
    assert had == set(catalog.NEEDS)
    for f in catalog.FAMILIES:
        assert f.needs in (catalog.ANYWHERE, *catalog.NEEDS), f.name
        assert f.full_only in ("", catalog.EVERYWHERE, *catalog.NEEDS), f.name
        assert any(f.served(m.traits.has) for m in MODES.values()), f.name


def test_the_basic_level_serves_no_detail_family_and_the_full_level_serves_them() -> None:
    """GPUMEM_DETAIL=basic (the default) keeps the families declared `detail` off the scrape
    of those modes; full serves them (the test above sees every one served)."""
    _, demo = read_trace(demo_trace_path())
    cases = [("embedded", False, demo[0]), ("run", True, run_shaped(demo[0]))]
    cases.append(("node", False, node_shaped(demo[0])))
    for mode, per_process, sample in cases:
        has = MODES[mode].traits.has
        detailed = {f.exposed for f in catalog.FAMILIES if f.served(has) and f.full_only_in(has)}
        served = {}
        for detail in ("basic", "full"):
            text = _exposition(sample, mode, {}, per_process, detail)
            served[detail] = {f.name for f in text_string_to_metric_families(text)}
            served[detail] |= {f"{name}_info" for name in served[detail]}
            served[detail] |= {f"{name}_total" for name in served[detail]}
        assert served["basic"] & detailed == set(), mode
        assert served["full"] & detailed, mode


def test_an_endpoint_of_many_processes_names_a_ranked_one_without_its_pid() -> None:
    """`run` serves every process of a server (Traits.one_process is False): a worker named
    by its rank and role goes without its pid, so its series survive a restart; an endpoint
    of one process keeps every pid, as the multiprocess bridge reads it."""
    _, demo = read_trace(demo_trace_path())
    sample = run_shaped(demo[0])
    pids = {}
    for mode in ("run", "embedded"):
        text = _exposition(sample, mode, {}, per_process=True)
        [family] = [
            f
            for f in text_string_to_metric_families(text)
            if f.name == "torch_cuda_allocated_bytes"
        ]
        pids[mode] = {s.labels.get("pid") for s in family.samples}
    assert pids == {"run": {""}, "embedded": {"100"}}
