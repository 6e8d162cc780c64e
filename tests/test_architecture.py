"""The package's shape, read from its source: imports run one way (docs/architecture.md).

Every import counts, at module level, inside functions and under TYPE_CHECKING: a lazy import
is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "exporter"

# Bottom to top. A module may import from its own layer or any below, never from above.
LAYERS: list[tuple[str, ...]] = [
    # plain values and helpers every part uses
    (
        "version",
        "units",
        "request_counts",
        "traits",
        "atomic",
        "budget",
        "ratelimit",
        "no_redirects",
        "sigpipe",
        "cuda_init",  # callbacks the moment torch initializes CUDA: standard library only
        "port_holder",  # whether a port can be listened on, and who holds it
        "refusals",
        "catalog",
        "oom_verdict",
        "sample",
        "ledger",  # where a process's GPU memory goes, from a reading
        "components",  # what the server named its memory: standard library only
        "pools",  # what each private pool is, and its name
        "config",
        "identity",
        "probe",  # the serving process's tick: standard library only
        "proc_file",  # a /proc file kept open, read again from its start
        # every reach into uvicorn's, asyncio's and ssl's internals, named and checked
        "internals",
    ),
    # reading, keeping and rendering: sources and what turns samples into output
    (
        "sources",
        "kubernetes",
        "trace",
        "attribution",
        "process_labels",
        "alerts",
        "detectors",
        "window",
        "oom_pending",
        "fill",  # the catalog's families filled from a sample, one module per subject
        "metrics",
        "own_process_metrics",  # client_python's process_* families, read more cheaply
        "exposition",
        "exposition_templates",
        "viewer",
        "sampler",
        "health",  # what /healthz says, from the sampler's state
        "multiprocess",
        "record",
        "answers",
        "runbooks",  # the packaged runbooks as HTML
        "page_data",  # what the live page shows of a sample
    ),
    ("actions",),  # what the admin API can do, one implementation per mode
    ("webconfig",),  # the web config file and the endpoint's rules it sets (exporter-toolkit's)
    ("http", "client"),  # the endpoint (/metrics, the admin API, the live page); its client
    ("runtime", "modes"),  # assembly: one declaration per way of running
    # the agents' channel that `run` and exporter.start()'s helper share, and what serves it
    ("transport",),
    # entry points; reference writes docs/ tables from the declarations, contract the
    # metrics contract (metrics-contract.json)
    ("helper", "run", "embedded", "cli", "__init__", "reference", "contract"),
]


def _unit(module: str) -> str:
    """exporter.http.admin -> http; exporter -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        if "podresources_v1" in path.parts:  # generated gRPC code
            continue
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The exporter modules `name` imports, anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from exporter import atomic` imports the module atomic; `from exporter import
            # __version__` (or start, attach) imports the package's face, exporter/__init__.py,
            # which sits at the top: it counts like any other import.
            targets = [f"{base}.{alias.name}" for alias in node.names]
            if base != "exporter":
                targets.append(base)
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_and_package_sits_in_a_layer_and_every_layer_entry_exists() -> None:
    placed = {unit for layer in LAYERS for unit in layer}
    units = {_unit(name) for name in _graph()}
    assert units <= placed, f"place these in LAYERS: {sorted(units - placed)}"
    assert placed <= units, f"LAYERS names what the package lacks: {sorted(placed - units)}"


def test_no_module_imports_from_a_layer_above_it() -> None:
    layer_of = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    upward = [
        f"{name} -> {target}"
        for name, targets in _graph().items()
        for target in sorted(targets)
        if layer_of[_unit(target)] > layer_of[_unit(name)]
    ]
    assert not upward, "imports running up:\n" + "\n".join(upward)


def test_no_import_circles_between_modules_or_between_packages() -> None:
    graph = _graph()
    assert _cycles(graph) == []
    packages: dict[str, set[str]] = {}
    for name, targets in graph.items():
        unit = _unit(name)
        packages.setdefault(unit, set()).update(_unit(t) for t in targets if _unit(t) != unit)
    assert _cycles(packages) == []


def test_no_function_is_longer_than_100_lines() -> None:
    long = []
    for path in ROOT.rglob("*.py"):
        if "podresources_v1" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 100:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}")
    assert long == []


TESTS = Path(__file__).resolve().parent
# Folders of tests for what ships beside the package, and the stand-ins and programs they run.
BESIDE_THE_PACKAGE = {"deploy", "e2e", "gpu", "support", "data", "js"}


def test_tests_mirror_the_package() -> None:
    """tests/<x>/ holds the tests of exporter/<x>/ (or of what ships beside it)."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders - packages - BESIDE_THE_PACKAGE == set()


def test_no_test_module_imports_another() -> None:
    """Shared code lives in tests/helpers.py, tests/conftest.py and tests/support/."""
    found = []
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(
                n.startswith("tests.") and n.rpartition(".")[2].startswith("test_") for n in names
            ):
                found.append(str(path.relative_to(TESTS)))
    assert found == []


# The sources of one thing a mode reads (an allocator, a device's memory, ...): made only by
# exporter.sources.kinds and found by what they provide, so that another allocator API or
# another vendor's device source is one module and one declaration.
READING_SOURCES = {"torch_allocator", "accelerator_allocator", "nvml", "host", "kubelet"}


def test_only_the_source_table_names_a_reading_source() -> None:
    named = [
        f"{name} -> {target}"
        for name, targets in _graph().items()
        if not name.startswith("exporter.sources")
        for target in targets
        if target.removeprefix("exporter.sources.") in READING_SOURCES
    ]
    assert named == []
