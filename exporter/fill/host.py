"""The host's memory: each served process's (host_process), then the machine's and, where the
serving process is one it reports, that process's own."""

from __future__ import annotations

from exporter import catalog
from exporter.fill.render import Render
from exporter.fill.rows import Filled
from exporter.sample import Sample

_HOST_PROCESS = catalog.group("host_process")
MACHINE = catalog.group("machine_host")
OWN_PROCESS = catalog.group("own_process_host")


def families(render: Render, sample: Sample) -> Filled:
    found: Filled = []
    new = render.plans.new
    for entry in _HOST_PROCESS if sample.host_processes else ():
        family = new(entry)
        for process in sample.host_processes:
            value = getattr(process, entry.key)
            if value is not None:
                family.add(render.processes.labels(vars(process)), value)
        found.append((family, False))
    host = sample.host
    if host is None:
        return found
    for entry in render.about.host:
        value = getattr(host, entry.key)
        if value is not None:
            family = new(entry)
            family.add({}, value)
            found.append((family, True))
    return found
