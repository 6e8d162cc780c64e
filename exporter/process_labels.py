"""Which processes' series go without a pid, so that they keep their identity across restarts.

Under `gpumem-exporter run` one endpoint serves every process of a server. A restart gives each
process a new pid; were the pid on every series, a restart would replace nearly every series
the endpoint serves (82% of them on a TP=8 server), and a fleet whose servers restart every
few hours would pile up series Prometheus keeps for hours after. So a process whose rank and
role no other process of the endpoint shares (a ranked worker; the one API process) is named by
them alone, and its pid is only in gpumem_exporter_process_info, to join on where needed. A
process that has neither, or shares them (two workers of one role without ranks), keeps its pid:
without it two processes' series would collide. Elsewhere (an endpoint in or beside one process)
every pid stays: there a series without one is about the serving process itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping


def _key(process: Mapping[str, object]) -> tuple[str, str]:
    return str(process.get("rank", "") or ""), str(process.get("role", "") or "")


class ProcessLabels:
    """The processes of one rendering: their labels, with the pid blanked where not needed."""

    def __init__(self, processes: Iterable[Mapping[str, object]], *, every_pid: bool = False):
        """every_pid: keep every pid (an endpoint of one process, where a series without a pid
        is read as that process's own, as the multiprocess bridge does)."""
        by_pid: dict[str, Mapping[str, object]] = {}
        for process in processes:
            pid = str(process.get("pid", "") or "")
            if pid:
                by_pid.setdefault(pid, process)
        shared = Counter(_key(p) for p in by_pid.values())
        self.processes = by_pid
        self._keeps_pid = {
            pid
            for pid, p in by_pid.items()
            if every_pid or _key(p) == ("", "") or shared[_key(p)] > 1
        }

    def keeps_pid(self, pid: object) -> bool:
        return str(pid) in self._keeps_pid

    def labels(self, labels: Mapping[str, object]) -> Mapping[str, object]:
        """These labels, less the pid where the other labels name the process alone."""
        pid = labels.get("pid")
        if pid in (None, "") or self.keeps_pid(pid):
            return labels
        return {**labels, "pid": ""}
