"""gpumem-exporter: PyTorch CUDA allocator, NVML and host memory metrics for Prometheus.

    import exporter
    exporter.start()          # a probe thread here; /metrics on 127.0.0.1:9445 from a helper
    exporter.attach(app)      # or: mount on your own FastAPI app and registry
    with exporter.component("weights"):   # name what memory is for: the memory ledger
        model = load_model().cuda()

The embedding API is imported on first use, so that `import exporter.<module>` stays cheap:
under `gpumem-exporter run` every Python process of a server loads a small agent from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exporter.version import __version__

if TYPE_CHECKING:
    from exporter.components import component, release_component, set_component
    from exporter.embedded import Handle, attach, start, stop
    from exporter.pools import name_pool

__all__ = [
    "Handle",
    "__version__",
    "attach",
    "component",
    "name_pool",
    "release_component",
    "set_component",
    "start",
    "stop",
]


def __getattr__(name: str) -> Any:
    if name in ("Handle", "attach", "start", "stop"):
        from exporter import embedded

        return getattr(embedded, name)
    if name in ("component", "release_component", "set_component"):
        from exporter import components

        return getattr(components, name)
    if name == "name_pool":
        from exporter import pools

        return pools.name_pool
    raise AttributeError(f"module 'exporter' has no attribute {name!r}")
