"""gpumem-exporter: PyTorch CUDA allocator, NVML and host memory metrics for Prometheus.

    import exporter
    exporter.start()          # a probe thread here; /metrics on 127.0.0.1:9445 from a helper
    exporter.attach(app)      # or: mount on your own FastAPI app and registry

The embedding API is imported on first use, so that `import exporter.<module>` stays cheap:
under `gpumem-exporter run` every Python process of a server loads a small agent from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exporter.version import __version__

if TYPE_CHECKING:
    from exporter.embedded import Handle, attach, start, stop

__all__ = ["Handle", "__version__", "attach", "start", "stop"]


def __getattr__(name: str) -> Any:
    if name in ("Handle", "attach", "start", "stop"):
        from exporter import embedded

        return getattr(embedded, name)
    raise AttributeError(f"module 'exporter' has no attribute {name!r}")
