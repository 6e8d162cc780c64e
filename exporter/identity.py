"""Who a process is: the labels that tell the processes of one server apart.

Standard library only: the agent of `gpumem-exporter run` imports this at interpreter start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping


def process_title(pid: int | str = "self", proc: str = "/proc") -> str:
    """The base name of arg 0 of a process's command line, which reflects setproctitle()
    (servers like vLLM name their processes with it); "" if it cannot be read."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            return os.path.basename(f.read().split(b"\0")[0].decode(errors="replace"))
    except OSError:
        return ""


def multiprocessing_name() -> str:
    """The name a `multiprocessing` child was given (Process(name=...): LitServe's and vLLM's
    workers name themselves so), or "" in a main process or where multiprocessing is unused.
    Never imports multiprocessing."""
    module = sys.modules.get("multiprocessing")
    if module is None:
        return ""
    try:
        name = str(module.current_process().name)
    except Exception:  # a half-initialized module during interpreter start: no name
        return ""
    return "" if name == "MainProcess" else name


def process_role() -> str:
    """GPUMEM_ROLE, else the process title where the process set one (setproctitle: vLLM's
    "VLLM::EngineCore"), else its multiprocessing name, else the interpreter's name."""
    title = process_title()
    interpreter = title.startswith("python") or not title
    role = os.environ.get("GPUMEM_ROLE", "") or (
        (multiprocessing_name() or title) if interpreter else title
    )
    if not role:
        role = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return role[:64]


def process_labels() -> dict[str, str]:
    """pid, rank, local_rank and role of this process (catalog.PROCESS_LABELS)."""
    return {
        "pid": str(os.getpid()),
        "rank": os.environ.get("RANK", ""),
        "local_rank": os.environ.get("LOCAL_RANK", ""),
        "role": process_role(),
    }


def pod_name() -> str:
    """The pod this process runs in, where the chart gives it (POD_NAME, the downward API)."""
    return os.environ.get("POD_NAME", "")


def describe_process(process: Mapping[str, str]) -> str:
    """A process's labels in words, for error lines: "pid 12 rank 1 (worker)"."""
    rank = f" rank {process['rank']}" if process.get("rank") else ""
    role = f" ({process['role']})" if process.get("role") else ""
    return f"pid {process.get('pid', '?')}{rank}{role}"


def identity_labels(env: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """Labels put on every series of this process: rank/local_rank when set, then the user's."""
    labels = {}
    for key, name in (("RANK", "rank"), ("LOCAL_RANK", "local_rank")):
        if env.get(key):
            labels[name] = env[key]
    labels.update(extra)
    return labels
