"""The catalog's families filled from a sample: one module per subject, in /metrics' order.

exporter.catalog declares every family; each module here fills the families of its subject
from the part of the sample that carries them, so that a new reading is declared in the
catalog and filled in the one module of its subject:

- health: the exporter's own state (build, sources, alerts, processes, budgets), with
- actions: what the admin API did (snapshots, empty_cache, remediations) and the endpoint;
- allocator: each process's PyTorch caching allocator, and its pinned host memory;
- devices: the GPUs through NVML, and their MIG instances;
- kubernetes: the kubelet's view of the node, and which pod holds what;
- host: the host's memory and each process's.

exporter.fill.rows holds what they fill (plain rows, rendered through templates) and
exporter.fill.render what a render reads; exporter.metrics.SampleCollector calls them in order.
"""
