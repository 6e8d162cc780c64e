"""The metric catalog (exporter/catalog.py) is the one list of families: the collector serves
only what it declares, as it declares it, serves every family it declares in some mode, and
docs/metrics.md carries its table."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter import catalog, reference
from exporter.catalog import PROCESS_LABELS
from exporter.metrics import ActionStats, SampleCollector
from exporter.sample import (
    ActionCounts,
    ExporterState,
    HostProcessReading,
    KubeletReading,
    PodDevice,
    ProcessContainerReading,
    ProcessCounts,
    ProcessGpuReading,
    Sample,
    SourceStatus,
)
from exporter.sources.replay import demo_trace_path
from exporter.trace import read_trace
from exporter.window import FIELDS
from tests.conftest import DATA_DIR
from tests.helpers import captured_oom_samples, captured_sample

# client_python's own collectors, registered beside ours: not the exporter's families.
_CLIENT_PYTHON = re.compile(r"^(process_(?!resident_memory_peak)|python_)")
_BY_EXPOSED = {f.exposed: f for f in catalog.FAMILIES}
WORKER = {"pid": "100", "rank": "0", "local_rank": "0", "role": "worker"}


def _exposition(
    sample: Sample, mode: str, const: dict[str, str], per_process: bool, detail: str = "full"
) -> str:
    state = ExporterState(
        sample,
        {
            "torch": SourceStatus(True, 0.01, 1),
            "nvml": SourceStatus(False, 0.2, 3, unavailable="NVML library not found"),
        },
    )
    counts = ActionCounts({"manual": 2}, 4096, {"empty_cache/ok": 1})
    process = WORKER if per_process else {}
    stats = ActionStats([ProcessCounts(process, counts)], {("snapshot", "ok"): 1})
    alerts = SimpleNamespace(
        evaluations=1,
        firing=lambda: [
            ("GpuMemOutOfMemory", {"device": "0", "gpu_uuid": "GPU-x", **process}, True)
        ],
    )
    registry = CollectorRegistry()
    registry.register(
        SampleCollector(
            lambda: state,
            const_labels=const,
            version="0",
            mode=mode,
            own_process=mode != "demo",
            alerts=alerts,
            actions=lambda: stats,
            detail=detail,
        )
    )
    return generate_latest(registry).decode()


def _run_shaped(sample: Sample) -> Sample:
    """One endpoint for a server's processes: every reading names its process."""
    sample = copy.deepcopy(sample)
    for reading in [*sample.allocators, *sample.pinned_host]:
        reading.process = dict(WORKER)
    sample.rejected_messages = {"bad_json": 1}
    sample.host_processes.append(HostProcessReading(100, "worker", "0", 1 << 30, 1 << 31, 0))
    return sample


def _node_shaped(sample: Sample) -> Sample:
    """The node daemon: NVML, the kubelet's devices and the processes' cgroups."""
    sample = copy.deepcopy(sample)
    sample.allocators, sample.pinned_host = [], []
    gpu = sample.gpus[0]
    sample.processes = [
        ProcessGpuReading(gpu.index, gpu.uuid, 4242, 1 << 30),
        ProcessGpuReading(gpu.index, gpu.uuid, 4343, 1 << 20),
    ]
    sample.kubelet = KubeletReading(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        up=False,
        error="deadline exceeded",
        last_success_s=1.0,
        refresh_errors=1,
        devices=[PodDevice("ml", "llama-0", "server", "nvidia.com/gpu", gpu.uuid)],
        pods={"uid-1": ("ml", "llama-0")},
        containers={"cid-1": "server"},
        pods_api=True,
        pods_error="403 Forbidden",
    )
    sample.process_containers = [
        ProcessContainerReading(4242, "container", "uid-1", "cid-1"),
        ProcessContainerReading(4343, "no_container"),
    ]
    return sample


def _expositions() -> list[tuple[str, bool, str]]:
    """(mode, per_process, text) over real readings: three allocator backends captured on a
    GPU, the demo trace (layout, private pools, pinned host) and the storm trace (layout
    skipped), each served as its modes would."""
    _, demo = read_trace(demo_trace_path())
    _, storm = read_trace(DATA_DIR / "h200_oom_storm_trace.jsonl.gz")
    samples = [captured_sample(n) for n in ("native", "expandable", "async")]
    samples += demo[::40] + storm[::10] + captured_oom_samples()
    found = []
    for sample in samples:
        found.append(("embedded", False, _exposition(sample, "embedded", {"rank": "0"}, False)))
        found.append(("demo", False, _exposition(sample, "demo", {}, False)))
        found.append(("run", True, _exposition(_run_shaped(sample), "run", {}, True)))
    found.append(("node", False, _exposition(_node_shaped(demo[0]), "node", {}, False)))
    return found


def test_every_family_served_is_declared_with_its_type_and_labels() -> None:
    served: set[str] = set()
    for mode, per_process, text in _expositions():
        for family in text_string_to_metric_families(text):
            if _CLIENT_PYTHON.match(family.name):
                continue
            # The text format shows an info family as a gauge named <name>_info.
            entry = _BY_EXPOSED.get(family.name) or catalog.family(family.name)
            assert mode in entry.modes, f"{entry.name} served in {mode}"
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


def test_the_catalog_names_the_declared_modes() -> None:
    from exporter.runtime import MODES

    assert set(catalog.MODES) == set(MODES)


def test_the_basic_level_serves_no_detail_family_and_the_full_level_serves_them() -> None:
    """GPUMEM_DETAIL=basic (the default) keeps the families declared `detail` off the scrape
    of those modes; full serves them (the test above sees every one served)."""
    _, demo = read_trace(demo_trace_path())
    cases = [("embedded", False, demo[0]), ("run", True, _run_shaped(demo[0]))]
    cases.append(("node", False, _node_shaped(demo[0])))
    for mode, per_process, sample in cases:
        detailed = {f.exposed for f in catalog.FAMILIES if mode in f.detail}
        served = {}
        for detail in ("basic", "full"):
            text = _exposition(sample, mode, {}, per_process, detail)
            served[detail] = {f.name for f in text_string_to_metric_families(text)}
            served[detail] |= {f"{name}_info" for name in served[detail]}
            served[detail] |= {f"{name}_total" for name in served[detail]}
        assert served["basic"] & detailed == set(), mode
        assert served["full"] & detailed, mode
