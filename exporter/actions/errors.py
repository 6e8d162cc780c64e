"""How an action can fail in one process, and the HTTP status each failure stands for.

Its own module so that what raises them (the snapshot store, the allocator actions) and what
answers them (the admin routes, the fan-out) depend on it, not on each other.
"""

from __future__ import annotations

# Outcomes of one process's action, and the HTTP status each stands for when every selected
# process ended the same way.
OUTCOME_STATUS = {
    "ok": 200,
    "unavailable": 409,  # not now: CUDA not initialized yet, device not in use
    "conflict": 409,  # another capture is recording
    "cooldown": 429,
    "invalid": 422,  # parameters the action does not take (a launcher of another version)
    "unsupported": 501,  # never here: cudaMallocAsync has no snapshots
    "error": 500,
    # The snapshot folder cannot take the file: full, over quota, read-only, or not ours.
    "insufficient_storage": 507,
    "unreachable": 502,  # the process's agent could not be reached
    "timeout": 504,
}


class ActionFailed(RuntimeError):
    """An action that cannot run here; `outcome` says why (a key of OUTCOME_STATUS)."""

    outcome = "error"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ActionUnavailable(ActionFailed):
    """Not possible now (409), or never with this allocator (501 when `unsupported`)."""

    def __init__(self, message: str, *, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported
        self.outcome = "unsupported" if unsupported else "unavailable"


class ActionConflict(ActionFailed):
    outcome = "conflict"


class ActionCooldown(ActionFailed):
    outcome = "cooldown"


class ActionInsufficientStorage(ActionFailed):
    """The result could not be stored (507); the message says why (the errno's text)."""

    outcome = "insufficient_storage"
