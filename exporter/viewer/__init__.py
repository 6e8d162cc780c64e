"""A self-contained, offline HTML viewer for PyTorch CUDA allocator snapshots.

`torch.cuda._memory_viz` writes pages that load MemoryViz.js and d3 from public CDNs, so they
are blank on an air-gapped cluster. This package renders the same data (the dict returned by
`torch.cuda.memory._snapshot()`) into one HTML page that loads nothing:

- `load`: reads a snapshot file (plain or gzip-compressed pickle) with a restricted
  unpickler, within limits on size, objects and keys;
- `model`: the snapshot as typed records (segments, blocks, frames, history) and totals;
- `markup`: HTML built by construction, every value escaped unless it is markup already;
- `render`: the page, a pure function of the snapshot dict, within limits on work and size.
"""

from exporter.viewer.load import NO_HISTORY_MESSAGE, SnapshotError, load_snapshot
from exporter.viewer.render import PAGE_CSP, render_html

__all__ = ["NO_HISTORY_MESSAGE", "PAGE_CSP", "SnapshotError", "load_snapshot", "render_html"]
