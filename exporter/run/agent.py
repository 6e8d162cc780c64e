"""The agent of `gpumem-exporter run` in each Python process of the server: started at
interpreter start by sitecustomize (exporter/run/inject), reporting to the launcher's run
folder (GPUMEM_RUN_DIR), with the launcher's settings (its agent.json). The agent itself is
exporter.transport.agent's; this module only starts one per process, and again in a forked
child.

Standard library only at import time (the transport agent's own imports).
"""

from __future__ import annotations

import os

from exporter.transport.agent import Agent

RUN_DIR_ENV = "GPUMEM_RUN_DIR"

_agent: Agent | None = None


def start_agent() -> Agent | None:
    """Start this process's agent if it runs under `gpumem-exporter run` (idempotent)."""
    global _agent
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir or _agent is not None:
        return _agent
    _agent = Agent(run_dir)
    _agent.start()
    return _agent


def _after_fork_in_child() -> None:
    # Threads do not survive fork: a forked worker gets an agent of its own, which stays idle
    # until the worker initializes CUDA itself.
    global _agent
    if _agent is not None:
        _agent.forget()
        _agent = None
        start_agent()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
