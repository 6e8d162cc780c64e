"""Who a process is: the labels that tell the processes of one server apart.

Standard library only: the agent of `gpumem-exporter run` imports this at interpreter start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping


def command_line(pid: int | str = "self", proc: str = "/proc") -> list[str]:
    """A process's arguments, as setproctitle() may have rewritten them; [] if unreadable."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            raw = f.read(1 << 16)
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")] if raw else []


def process_title(pid: int | str = "self", proc: str = "/proc") -> str:
    """The base name of arg 0 of a process's command line, which reflects setproctitle()
    (servers like vLLM name their processes with it); "" if it cannot be read."""
    args = command_line(pid, proc)
    return os.path.basename(args[0]) if args else ""


# What Python's multiprocessing runs with `python -c` (spawn and forkserver start methods):
# its helpers and its workers, named as a role (issue 38: under torch.multiprocessing.spawn
# the parent, the resource tracker and the workers were all "python").
_MULTIPROCESSING_CODE = (
    ("multiprocessing.resource_tracker", "resource_tracker"),
    ("multiprocessing.forkserver", "forkserver"),
    ("multiprocessing.spawn", "spawn_worker"),
)
_OPTIONS_WITH_VALUE = {"-W", "-X", "-Q"}


def command_role(args: list[str], own_name: str = "") -> str:
    """The role a command line gives a process: its title where it set one (setproctitle:
    vLLM's "VLLM::EngineCore"); for a Python interpreter, `own_name` (its multiprocessing
    name, where the process itself can say it), else what it runs (_interpreter_role), else
    the interpreter's name."""
    title = os.path.basename(args[0]) if args else ""
    if title.startswith("python") or not title:
        return own_name or _interpreter_role(args) or title
    return title


def _interpreter_role(args: list[str]) -> str:
    """What a Python interpreter's command line says it runs: the script's base name, the
    module of -m, or a multiprocessing helper or worker of -c; "" where it says nothing."""
    rest = iter(args[1:])
    for arg in rest:
        if arg == "-c":
            code = next(rest, "")
            return next((role for marker, role in _MULTIPROCESSING_CODE if marker in code), "")
        if arg == "-m":
            return next(rest, "")[:64]
        if arg in _OPTIONS_WITH_VALUE:
            next(rest, "")
        elif not arg.startswith("-"):
            return os.path.basename(arg)
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
    """GPUMEM_ROLE, else what its command line and multiprocessing name say (command_role),
    else the name it was started as."""
    role = os.environ.get("GPUMEM_ROLE", "") or command_role(command_line(), multiprocessing_name())
    if not role:
        role = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return role[:64]


def spawn_index() -> str:
    """The index torch.multiprocessing.spawn gave this worker (the `i` its function gets,
    by convention the local rank), or "". Read from the Process object multiprocessing
    made of this process; never imports torch or multiprocessing."""
    module = sys.modules.get("multiprocessing")
    if module is None:
        return ""
    try:
        process = module.current_process()
        target = getattr(process, "_target", None)
        if getattr(target, "__module__", "") != "torch.multiprocessing.spawn":
            return ""
        index = tuple(getattr(process, "_args", ()))[1]
    except Exception:  # another shape of a private attribute: no index
        return ""
    return str(index) if isinstance(index, int) and not isinstance(index, bool) else ""


def process_labels() -> dict[str, str]:
    """pid, rank, local_rank and role of this process (catalog.PROCESS_LABELS). local_rank:
    LOCAL_RANK, else torch.multiprocessing.spawn's index for its worker."""
    return {
        "pid": str(os.getpid()),
        "rank": os.environ.get("RANK", ""),
        "local_rank": os.environ.get("LOCAL_RANK", "") or spawn_index(),
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
