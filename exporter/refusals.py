"""What the CLI tells its user when an exporter answers 401: which credentials it asked for,
from its WWW-Authenticate challenge (the web config's basic auth, or the admin API's bearer
token), so that nobody is told to pass a token where a password is wanted."""

from __future__ import annotations

BASIC_AUTH = (
    "the exporter asks for basic auth: pass --user and --password-file (or GPUMEM_PASSWORD)"
)


def basic_auth_hint(challenge: str | None, sent: bool) -> str | None:
    """The hint where a 401's challenge (its WWW-Authenticate) is basic auth (`sent`: a user
    and password went with the request, and were refused), else None."""
    if not (challenge or "").lower().startswith("basic"):
        return None
    return BASIC_AUTH + (": the user or password given was refused" if sent else "")
