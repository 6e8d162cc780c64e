"""gpumem-exporter: PyTorch CUDA allocator, NVML and host memory metrics for Prometheus.

import exporter
exporter.start()          # sidecar thread + /metrics on 127.0.0.1:9445
exporter.attach(app)      # or: mount on your own FastAPI app and registry
"""

from __future__ import annotations

__version__ = "0.1.0"

from exporter.embedded import Handle, attach, start, stop

__all__ = ["Handle", "__version__", "attach", "start", "stop"]
