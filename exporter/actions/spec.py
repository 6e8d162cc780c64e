"""Every admin action, declared once: its name, route, typed parameters and how it answers.

From this list come the admin API's routes and request models (exporter.http.admin), the
fan-out's messages and the agents' dispatch under `gpumem-exporter run` (exporter.run), the
client's requests (exporter.client) and the CLI's options (exporter.cli). Adding an
action is one `Action` here and one method on each implementation of `base.Actions`.

Parameters are checked here (`Action.check`), with the same bounds the HTTP models declare,
so an agent never runs what a launcher of another version sends it unchecked. Standard
library only: agents load this inside the server's processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exporter.actions.base import DEFAULT_HISTORY_ENTRIES, HistoryParams
from exporter.actions.snapshots import MAX_RECORD_S

if TYPE_CHECKING:
    from exporter.actions.base import ActionMethods, ProcessResult, Target


class ParamError(ValueError):
    """A parameter that is not one the action takes, or out of its bounds (one line)."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: type  # int, float, bool or str
    help: str
    default: Any = None  # None: not given unless the caller gives it
    required: bool = False
    minimum: float | None = None  # inclusive
    above: float | None = None  # exclusive minimum
    maximum: float | None = None  # inclusive
    choices: tuple[str, ...] = ()
    flag: str = ""  # the CLI option, where the CLI offers one

    def check(self, value: Any) -> Any:
        """The value (a default where None is given), or ParamError naming the parameter."""
        problem = self.problem(value)
        if problem:
            raise ParamError(f"{self.name}: {problem}")
        # JSON has one number type: an integral record_s arrives as an int.
        return float(value) if self.kind is float and type(value) is int else value

    def problem(self, value: Any) -> str:
        """Why `value` is not one this parameter takes ("" if it is), without its name, so
        the CLI can put its flag in front."""
        if value is None:
            return "required" if self.required or self.default is not None else ""
        number = self.kind is float and type(value) is int  # a bool is never a number here
        if type(value) is not self.kind and not number:
            return f"expected {self.kind.__name__}, got {value!r:.40}"
        return self._out_of_bounds(value)

    def _out_of_bounds(self, value: Any) -> str:
        if self.kind is float and not math.isfinite(value):
            return "must be a finite number"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        if self.minimum is not None and value < self.minimum:
            return f"must be at least {self.minimum:g}"
        if self.above is not None and value <= self.above:
            return f"must be above {self.above:g}"
        if self.maximum is not None and value > self.maximum:
            return f"must be at most {self.maximum:g}"
        return ""


def _no_check(results: list[ProcessResult]) -> str | None:
    return None


def _ok(results: list[ProcessResult]) -> int:
    return 200


@dataclass(frozen=True)
class Action:
    name: str  # the Actions method, the word agents are sent and the admin counter's label
    method: str  # HTTP
    path: str
    help: str  # the route's description (OpenAPI)
    params: tuple[Param, ...]
    # this action's call on an implementation that runs it, with checked parameters
    call: Callable[[ActionMethods, Target, dict[str, Any]], list[ProcessResult]]
    # the status of an answer where every process succeeded
    ok_status: Callable[[list[ProcessResult]], int] = _ok
    # why a successful answer is still a conflict (409), or None
    conflict: Callable[[list[ProcessResult]], str | None] = _no_check
    counted_as: str = ""  # the admin counter's label, where it differs from name
    other_statuses: tuple[tuple[int, str], ...] = ()  # documented besides ok_status([])

    @property
    def label(self) -> str:
        return self.counted_as or self.name

    def check(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter, given or default, checked; ParamError for one not taken."""
        unknown = set(given) - {p.name for p in self.params}
        if unknown:
            raise ParamError(f"{self.name} takes no parameter {', '.join(sorted(unknown))}")
        checked = {}
        for param in self.params:
            value = given.get(param.name)
            checked[param.name] = param.check(param.default if value is None else value)
        return checked

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)


# -- parameters --------------------------------------------------------------------------

DEVICE = Param(
    "device",
    int,
    "Which GPU the call runs on, by its number inside the server process (the CUDA device "
    "number after CUDA_VISIBLE_DEVICES, not nvidia-smi's index); it must be one the process "
    "uses. Default: the first GPU the process uses.",
    minimum=0,
    maximum=1023,
    flag="--device",
)
MAX_ENTRIES = Param(
    "max_entries",
    int,
    "History ring buffer size.",
    default=DEFAULT_HISTORY_ENTRIES,
    minimum=1,
    maximum=1_000_000,
    flag="--max-entries",
)
STACKS = Param(
    "stacks",
    str,
    "Stack frames recorded with each allocation: python, or all (Python, C++ and CUDA; "
    "slower to record).",
    default="python",
    choices=("python", "all"),
    flag="--stacks",
)
CONTEXT = Param(
    "context",
    str,
    "Which events keep a stack: all, alloc (allocations only) or state (live blocks only).",
    default="all",
    choices=("all", "alloc", "state"),
)
HISTORY = (MAX_ENTRIES, STACKS, CONTEXT)


def _history(params: Mapping[str, Any]) -> HistoryParams:
    return HistoryParams(params["max_entries"], params["stacks"], params["context"])


def _recording(results: list[ProcessResult]) -> int:
    """201 for a snapshot written, 202 while any selected process records its window."""
    recording = any(r.ok and (r.result or {}).get("status") == "recording" for r in results)
    return 202 if recording else 201


def _nothing_stopped(results: list[ProcessResult]) -> str | None:
    if results and all(r.ok and (r.result or {}).get("stopped") is None for r in results):
        return "no capture is recording"
    return None


# -- the actions -------------------------------------------------------------------------

SNAPSHOT = Action(
    "snapshot",
    "POST",
    "/snapshot",
    "Capture an allocator snapshot in each selected process now, or record history for "
    "`record_s` and then dump (202, each entry `recording`). Holds the GIL while it builds "
    "stack frames: ~2 ms without history, seconds with 50k live blocks with stacks "
    "(docs/performance.md).",
    (
        Param(
            "record_s",
            float,
            f"Record allocation history for this many seconds (at most {MAX_RECORD_S}), then "
            "dump (202); POST /snapshot/stop ends it sooner.",
            above=0,
            maximum=MAX_RECORD_S,
            flag="--record-s",
        ),
        *HISTORY,
    ),
    lambda actions, target, p: actions.snapshot(
        target, record_s=p["record_s"], history=_history(p)
    ),
    ok_status=_recording,
    other_statuses=((202, "recording; poll GET /snapshots/{id}/info of each process"),),
)
STOP_CAPTURE = Action(
    "stop_capture",
    "POST",
    "/snapshot/stop",
    "End the windowed capture (`record_s`) of each selected process now and write what it "
    "recorded so far; 409 when no selected process is recording.",
    (),
    lambda actions, target, p: actions.stop_capture(target),
    conflict=_nothing_stopped,
    counted_as="snapshot_stop",
)
EMPTY_CACHE = Action(
    "empty_cache",
    "POST",
    "/empty-cache",
    "Return fully free cached segments to the driver, in each selected process. It waits "
    "for all GPU work queued on the process's streams and blocks its allocations meanwhile "
    "(measured at 3 s with 3 s of work queued): rate-limited per process, 429 with "
    "Retry-After within the cooldown. PyTorch empties the cache of every GPU of the process, "
    "whichever device the call runs on.",
    (DEVICE,),
    lambda actions, target, p: actions.empty_cache(target, device=p["device"]),
)
HISTORY_STATUS = Action(
    "history",
    "GET",
    "/history",
    "Whether each process records allocation history, and with what limits.",
    (),
    lambda actions, target, p: actions.history(target),
)
SET_HISTORY = Action(
    "set_history",
    "POST",
    "/history",
    "Start or stop recording allocation history (always bounded by max_entries) in each "
    "selected process. Stopping clears PyTorch's buffer, so by default a snapshot is taken "
    "first.",
    (
        Param("enabled", bool, "Record (true) or stop recording (false).", required=True),
        *HISTORY,
        Param(
            "snapshot_before_stop",
            bool,
            "Stopping clears the history buffer: dump it first.",
            default=True,
        ),
    ),
    lambda actions, target, p: actions.set_history(
        target,
        enabled=p["enabled"],
        history=_history(p),
        snapshot_before_stop=p["snapshot_before_stop"],
    ),
    counted_as="history",
)
RESET_PEAK = Action(
    "reset_peak",
    "POST",
    "/reset-peak",
    "Set peak = current. Global to each process: it also resets what the application's own "
    "torch.cuda.max_memory_allocated() reports.",
    (DEVICE,),
    lambda actions, target, p: actions.reset_peak(target, device=p["device"]),
)

ACTIONS = (SNAPSHOT, STOP_CAPTURE, EMPTY_CACHE, HISTORY_STATUS, SET_HISTORY, RESET_PEAK)
BY_NAME = {action.name: action for action in ACTIONS}
