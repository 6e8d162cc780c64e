"""SIGPIPE blocked in the exporter's own threads that write to sockets, in a host process.

A write to a socket (or pipe) whose other end is gone raises SIGPIPE at the writing thread,
and SIGPIPE's default action ends the process. Python ignores it from start-up, but a host
may not: a C++ server embedding Python, or a CLI that restores the default to die quietly in
a shell pipe. There the exporter's write to a Prometheus that hung up, or to a helper that
died, would kill the server it watches. Blocked in the writing thread, the signal stays
pending there and the write fails with EPIPE, which the exporter handles; the host's own
threads and handlers are left as they are. Standard library only (the probe imports it).
"""

from __future__ import annotations

import contextlib
import signal


def block_sigpipe_in_this_thread() -> None:
    """Block SIGPIPE in the calling thread and the threads it starts from now on."""
    with contextlib.suppress(AttributeError, OSError, ValueError):  # not POSIX
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
