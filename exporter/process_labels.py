"""Which processes' series go without a pid, so that they keep their identity across restarts.

Under `gpumem-exporter run` one endpoint serves every process of a server. A restart gives each
process a new pid; were the pid on every series, a restart would replace nearly every series
the endpoint serves (82% of them on a TP=8 server), and a fleet whose servers restart every
few hours would pile up series Prometheus keeps for hours after. So a process whose rank and
role no other process of the endpoint shares (a ranked worker; the one API process) is named by
them alone, and its pid is only in gpumem_exporter_process_info, to join on where needed. A
process that has neither, or shares them (two workers of one role without ranks), keeps its pid:
without it two processes' series would collide. Each process keeps its first decision while it
is served: a process that joins with the rank and role of one served without its pid takes its
own pid, and the first one's series stay as they were. Elsewhere (an endpoint in or beside one
process) every pid stays: there a series without one is about the serving process itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping


def _key(process: Mapping[str, object]) -> tuple[str, str]:
    return str(process.get("rank", "") or ""), str(process.get("role", "") or "")


class ProcessLabels:
    """The processes of one rendering: their labels, with the pid blanked where not needed."""

    def __init__(
        self,
        processes: Iterable[Mapping[str, object]],
        *,
        every_pid: bool = False,
        decided: dict[str, tuple[tuple[str, str], bool]] | None = None,
    ):
        """every_pid: keep every pid (an endpoint of one process, where a series without a pid
        is read as that process's own, as the multiprocess bridge does). decided: pid -> (its
        rank and role, kept), the decisions of earlier renderings, kept up to date here: a
        process keeps its decision for as long as it is served with the same rank and role,
        so that another joining or leaving never changes its series (one server alone went
        without its pid, and took it when a second of its role joined). A process whose rank
        or role changes (a fork that names its own) has new series anyway: decided again."""
        by_pid: dict[str, Mapping[str, object]] = {}
        for process in processes:
            pid = str(process.get("pid", "") or "")
            if pid:
                by_pid.setdefault(pid, process)
        shared = Counter(_key(p) for p in by_pid.values())
        self.processes = by_pid
        earlier = decided if decided is not None else {}
        self._keeps_pid = set()
        for pid, process in by_pid.items():
            key = _key(process)
            before = earlier.get(pid)
            if before is not None and before[0] == key:
                keeps = before[1]
            else:
                keeps = every_pid or key == ("", "") or shared[key] > 1
            if keeps:
                self._keeps_pid.add(pid)
        if decided is not None:
            for gone in [pid for pid in decided if pid not in by_pid]:
                decided.pop(gone, None)  # pop: another thread's rendering may have taken it
            decided.update(
                (pid, (_key(process), pid in self._keeps_pid)) for pid, process in by_pid.items()
            )

    def keeps_pid(self, pid: object) -> bool:
        return str(pid) in self._keeps_pid

    def labels(self, labels: Mapping[str, object]) -> Mapping[str, object]:
        """These labels, less the pid where the other labels name the process alone."""
        pid = labels.get("pid")
        if pid in (None, "") or self.keeps_pid(pid):
            return labels
        return {**labels, "pid": ""}
