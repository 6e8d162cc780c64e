"""The metrics contract (exporter/contract.py, metrics-contract.json): the file is the
catalog's, a rename or removal made on purpose breaks it unless declared deprecated, a
deprecated name is served beside its replacement, and every mode's exposition holds to it."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter import catalog, contract
from exporter.sample import HostProcessReading
from exporter.sources.replay import demo_trace_path
from exporter.trace import read_trace
from tests.conftest import REPO_ROOT
from tests.helpers import (
    CLIENT_PYTHON,
    catalog_collector,
    every_family_cases,
    mig_node_sample,
    node_shaped,
    run_shaped,
)

RESERVED = "torch_cuda_reserved_bytes"


def _replaced(monkeypatch: pytest.MonkeyPatch, family: str, **changes: Any) -> None:
    """The catalog with `family` changed as `changes` say."""
    families = tuple(
        dataclasses.replace(f, **changes) if f.name == family else f for f in catalog.FAMILIES
    )
    monkeypatch.setattr(catalog, "FAMILIES", families)
    monkeypatch.setattr(catalog, "DEPRECATED", catalog.deprecated_names(families))


def test_the_contract_file_is_the_catalogs_and_nothing_in_it_is_broken() -> None:
    assert contract.problems() == []
    done = subprocess.run(
        [sys.executable, "-m", "exporter.contract", "--check"], cwd=REPO_ROOT, check=False
    )
    assert done.returncode == 0


def test_a_rename_made_on_purpose_breaks_the_contract(monkeypatch) -> None:
    _replaced(monkeypatch, RESERVED, name="torch_cuda_cached_bytes")
    found = contract.problems()
    assert f"{RESERVED}: removed without a deprecation (declare it replaced_by)" in found
    # And --write refuses it, naming it; the file is left as it was.
    before = contract.CONTRACT.read_bytes()
    assert contract.write() == found
    assert contract.CONTRACT.read_bytes() == before


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"labels": ("device",)}, "labels"),
        ({"kind": "counter"}, "removed without a deprecation"),  # it is `_total` now
        ({"needs": catalog.KUBERNETES}, "no longer served by embedded"),
        ({"full_only": catalog.EVERYWHERE}, "at the full detail level only now"),
    ],
)
def test_a_changed_family_breaks_the_contract(monkeypatch, changes, said) -> None:
    _replaced(monkeypatch, RESERVED, **changes)
    assert any(line.startswith(RESERVED) and said in line for line in contract.problems())


def test_a_deprecated_name_stays_a_minor_release_beside_its_replacement(
    monkeypatch, tmp_path
) -> None:
    """Renamed with the old name declared deprecated: no break; the old name may leave at
    the next minor release, not in a patch release of the same one."""
    released = tmp_path / "metrics-contract.json"
    released.write_bytes(contract.CONTRACT.read_bytes())
    new = dataclasses.replace(catalog.family(RESERVED), name="torch_cuda_segment_bytes")
    old = dataclasses.replace(
        catalog.family(RESERVED), replaced_by=new.name, deprecated_since="0.1.0"
    )
    without_old = tuple(f for f in catalog.FAMILIES if f.name != RESERVED)
    monkeypatch.setattr(catalog, "FAMILIES", (*without_old, new, old))
    assert contract.write(released, version="0.1.0") == []
    written = json.loads(released.read_text())["families"]
    assert written[RESERVED]["deprecated"] == {"replacement": new.name, "since": "0.1.0"}
    assert written[new.name]["since"] == "0.1.0"

    monkeypatch.setattr(catalog, "FAMILIES", (*without_old, new))  # the old name leaves
    assert contract.problems(released, version="0.1.3") == [
        f"{RESERVED}: deprecated in 0.1.0, removed in 0.1.3: it stays beside its replacement "
        "for a minor release"
    ]
    assert contract.problems(released, version="0.2.0") == [
        "metrics-contract.json is out of date: run python -m exporter.contract --write"
    ]


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_a_deprecated_name_is_served_beside_its_replacement_with_its_samples(
    monkeypatch,
) -> None:
    _, demo = read_trace(demo_trace_path())
    old = dataclasses.replace(
        catalog.family(RESERVED),
        name="torch_cuda_cached_bytes",
        replaced_by=RESERVED,
        deprecated_since="0.1.0",
    )
    monkeypatch.setattr(catalog, "DEPRECATED", {RESERVED: (old,)})
    for mode, per_process, sample in (
        ("embedded", False, demo[0]),
        ("run", True, run_shaped(demo[0])),
    ):
        registry = CollectorRegistry()
        registry.register(catalog_collector(sample, mode, {}, per_process, "basic"))
        served = _families(generate_latest(registry).decode())
        assert served[RESERVED], mode
        renamed = [s._replace(name=RESERVED) for s in served["torch_cuda_cached_bytes"]]
        assert renamed == served[RESERVED], mode


@pytest.mark.slow
def test_every_modes_exposition_holds_to_the_contract() -> None:
    """Each family a mode serves is in the contract for that mode, with its type and labels;
    and each (family, mode) the contract lists is served by that mode in some case."""
    families = contract.read()
    _, trace = read_trace(demo_trace_path())
    demo = trace[0]
    cases = every_family_cases()
    cases += [("helper", True, {}, s) for m, _, _, s in cases if m == "run"]
    # A MIG machine's NVML readings, and a GPU whose memory NVML cannot give, in every mode
    # that reads NVML (every_family_cases has them in the node daemon's only).
    for sample in (mig_node_sample(), mig_node_sample("h100-mig", in_slice=1)):
        cases += [("embedded", False, {}, sample), ("demo", False, {}, sample)]
        cases += [(mode, True, {}, run_shaped(sample)) for mode in ("run", "helper")]
    # A process's host memory as the replay and the node daemon's cgroups give it, and series
    # held to their budgets.
    for mode, sample in (("demo", demo), ("node", node_shaped(demo))):
        sample = copy.deepcopy(sample)
        sample.host_processes.append(HostProcessReading(100, "worker", "0", 1 << 30, 1 << 31, 0))
        sample.over_budget = {"per_process": 0, "per_endpoint": 0, "host_processes": 1}
        cases.append((mode, False, {}, sample))
    served: set[tuple[str, str]] = set()
    for mode, per_process, const, sample in cases:
        registry = CollectorRegistry()
        registry.register(catalog_collector(sample, mode, const, per_process, "full"))
        text = generate_latest(registry).decode()
        for family in text_string_to_metric_families(text):
            if CLIENT_PYTHON.match(family.name):
                continue
            names = (family.name, f"{family.name}_info", f"{family.name}_total")
            exposed = next((name for name in names if name in families), None)
            assert exposed is not None, f"{family.name} served by {mode}, not in the contract"
            promised = families[exposed]
            assert mode in promised["modes"], (exposed, mode)
            text_type = "gauge" if promised["type"] == "info" else promised["type"]
            assert family.type == text_type, exposed
            allowed = {"rank", *promised["labels"], *promised.get("info_labels", ())}
            if per_process:
                allowed |= set(promised.get("process_labels", ()))
            for row in family.samples:
                assert set(row.labels) <= allowed, (exposed, row.labels)
            served.add((exposed, mode))
    promised_pairs = {(name, mode) for name, e in families.items() for mode in e["modes"]}
    missing = sorted(promised_pairs - served)
    assert missing == [], "\n".join(map(str, missing))
