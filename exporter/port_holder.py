"""Whether a TCP port can be listened on now, and if not, who holds it: what a blocked start
says once in its log and on its handle. Standard library only.

The holder is read from /proc/net/tcp and tcp6, whose listening entries give the socket's
owner uid to everyone; its pid is found only where this user may read the owner's fds."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import socket


def port_taken(host: str, port: int) -> str | None:
    """Why `port` on `host` cannot be listened on now (who holds it), or None if it can (or
    the answer is not 'in use': whoever binds it then says why)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as trial:
        trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            trial.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use{holder(port)}"
            return None
    return None


def holder(port: int, proc: str = "/proc") -> str:
    """' (held by uid U (name), pid P)' for the process listening on `port`, as far as this
    user can tell; '' if nothing says."""
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc, "net", table)) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            if int(fields[1].rpartition(":")[2], 16) != port:
                continue
            uid, inode = int(fields[7]), fields[9]
            who = f"uid {uid}"
            with contextlib.suppress(KeyError):
                who += f" ({pwd.getpwuid(uid).pw_name})"
            pid = _pid_of_socket(inode, proc)
            return f" (held by {who}" + (f", pid {pid})" if pid else ")")
    return ""


def _pid_of_socket(inode: str, proc: str) -> int | None:
    target = f"socket:[{inode}]"
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        fds = os.path.join(proc, pid, "fd")
        try:
            for fd in os.listdir(fds):
                if os.readlink(os.path.join(fds, fd)) == target:
                    return int(pid)
        except OSError:
            continue  # another user's process, or gone
    return None
