"""One config object, filled from defaults, then `GPUMEM_*` environment, then explicit values.

Explicit values are CLI flags or keyword arguments to `exporter.start()`. Invalid values raise
ConfigError with a one-line message naming the setting and where it came from.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

DEFAULT_PORT = 9445
DEFAULT_HOST = "127.0.0.1"
ENV_PREFIX = "GPUMEM_"

log = logging.getLogger("exporter.config")


class ConfigError(ValueError):
    """A setting is invalid; str() is a one-line message for the user."""


@dataclass(frozen=True)
class Config:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    interval_s: float = 1.0
    # Constant labels on every series, e.g. {"model": "llama3-70b"}.
    labels: dict[str, str] = field(default_factory=dict)
    # Sample considered stale (and /healthz unhealthy) after this many seconds;
    # 0 means max(3 intervals, 5 s).
    stale_after_s: float = 0.0
    # One exporter per rank without `gpumem-exporter run`: listen on port + LOCAL_RANK.
    port_per_local_rank: bool = False
    # Which sources run: torch (allocator), nvml, host.
    torch: bool = True
    nvml: bool = True
    host_memory: bool = True
    # NVML's per-process GPU memory (its costliest read) is read at this pace, not every tick.
    process_interval_s: float = 10.0
    # The allocator's layout (largest free block, private pools) comes from a snapshot, which
    # stalls the serving thread ~0.7 us per block (docs/performance.md): read every this many
    # seconds (0 = never), and not at all above this many blocks.
    layout_interval_s: float = 10.0
    layout_max_blocks: int = 10_000
    # Kubernetes attribution in the node daemon: the kubelet's pod-resources socket ("" = the
    # kubelet's default path where this runs in Kubernetes or that socket exists; "off"),
    # how often it is asked (and at once when GPU processes change), each call's deadline,
    # and device-plugin resource names besides nvidia.com/gpu and nvidia.com/mig-* (a
    # trailing * matches a prefix).
    kubelet_socket: str = ""
    kubelet_refresh_s: float = 10.0
    kubelet_timeout_s: float = 5.0
    kubelet_resources: tuple[str, ...] = ()
    # Read this node's pods from the Kubernetes API (needs RBAC: the chart's podReader), so
    # that processes on shared GPUs are named, not only their pod UID.
    kubelet_pod_reader: bool = False
    # `run`: how long what is left of the command's process tree gets between SIGTERM and
    # SIGKILL when the launcher stops (shorter than Kubernetes' 30 s termination grace).
    stop_grace_s: float = 10.0
    # Automatic remediation (off by default): empty_cache on retries with high fragmentation,
    # a snapshot on the first OOM.
    remediate: bool = False
    remediate_cooldown_s: float = 300.0
    # Snapshots: where they are kept (default: <tmp>/gpumem-snapshots-<uid>) and how many.
    snapshot_dir: str | None = None
    snapshot_max_count: int = 20
    snapshot_max_bytes: int = 2 << 30
    # Allocation history recorded from start-up (0 = off), bounded to this many entries.
    history_max_entries: int = 0
    # On an OOM, capture a snapshot from the OOM observer (at most one per cooldown).
    oom_snapshot: bool = False
    oom_snapshot_cooldown_s: float = 60.0
    # Minimum seconds between two POST /empty-cache calls.
    empty_cache_cooldown_s: float = 10.0
    admin_token: str | None = field(default=None, repr=False)
    admin_token_file: str | None = None
    # Where the live page's alert links point (+ "#<alert in lower case>"), e.g. the
    # docs/runbooks.md of your fork; unset: the copy the exporter serves at /runbooks.
    runbook_url_base: str | None = None

    @cached_property
    def snapshot_directory(self) -> Path:
        """The snapshot folder, this user's alone (see private_folder_problem). Resolved once,
        so that `run` hands its agents the very folder the launcher lists.

        A configured folder of ours that others may write to is closed to them (a volume
        mounted 0777); one that is not ours, or a symlink, is a ConfigError (load_config
        raises it at start-up). The default one has a fixed name in a shared temp dir, which
        another local user may have created first: then a fresh private folder, with a
        warning.
        """
        if self.snapshot_dir:
            folder = Path(self.snapshot_dir)
            make_private_folder(folder, close_our_own=True)
            return folder
        default = Path(tempfile.gettempdir()) / f"gpumem-snapshots-{os.getuid()}"
        try:
            make_private_folder(default)
            return default
        except ConfigError as exc:
            problem = str(exc)
        try:
            fallback = Path(tempfile.mkdtemp(prefix=f"{default.name}-"))
        except OSError as exc:
            # Snapshots then answer 507 with the reason; the exporter itself still starts.
            log.warning("%s, and no private folder can be made: %s", problem, exc.strerror)
            return default
        log.warning("%s; snapshots go to %s instead", problem, fallback)
        return fallback

    @property
    def stale_threshold_s(self) -> float:
        return self.stale_after_s or max(3 * self.interval_s, 5.0)

    def resolved_admin_token(self) -> str | None:
        """The admin token, read from the file if one is named (so rotations are seen)."""
        if self.admin_token_file:
            return read_token_file(self.admin_token_file) or None
        return self.admin_token or None


def read_token_file(name: str | os.PathLike[str], *, server: bool = True) -> str:
    """The token in file `name`, stripped ("" if empty); ConfigError in one line if it cannot
    be read. The server and the CLI client read token files alike through this; only the
    server warns about a file every user can read (the client's output stays its answer)."""
    path = Path(name)
    try:
        text = path.read_text()
        if server:
            _warn_if_world_readable(path)
    except OSError as exc:
        raise ConfigError(f"cannot read admin token file {name}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"admin token file {name} is not text") from None
    return _token(text, f"admin token file {name}")


_warned_world_readable: set[str] = set()


def _warn_if_world_readable(path: Path) -> None:
    """Any local user can read such a token and call the admin API: say so, once per file."""
    if path.stat().st_mode & stat.S_IROTH and str(path) not in _warned_world_readable:
        _warned_world_readable.add(str(path))
        log.warning(
            "admin token file %s is readable by every user of this host: chmod o-r it", path
        )


def private_folder_problem(path: Path) -> str | None:
    """Why `path` must not hold snapshots, or None. It must be a folder (not a symlink) of
    this user that no one else may write to: whoever can add a file there can plant an entry
    that the server serves or, through retention, deletes."""
    try:
        info = path.lstat()
    except OSError as exc:
        return f"snapshot folder {path}: {exc.strerror}"
    if stat.S_ISLNK(info.st_mode):
        return f"snapshot folder {path} is a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return f"snapshot folder {path} is not a folder"
    if info.st_uid != os.getuid():
        owner, me = info.st_uid, os.getuid()
        return f"snapshot folder {path} belongs to uid {owner}, not to this user ({me})"
    if info.st_mode & 0o022:
        mode = stat.S_IMODE(info.st_mode)
        return f"snapshot folder {path} is writable by group or others (mode {mode:o})"
    return None


def make_private_folder(path: Path, *, close_our_own: bool = False) -> None:
    """Create `path` for this user only, if missing; ConfigError if it is not private.
    `close_our_own`: a folder of ours that others may write to is closed to them instead."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ConfigError(f"cannot create snapshot folder {path}: {exc.strerror}") from None
    if close_our_own:
        _close_our_own(path)
    problem = private_folder_problem(path)
    if problem is not None:
        raise ConfigError(problem)


def _close_our_own(path: Path) -> None:
    """Make a folder of ours writable by us alone (a volume mounted 0777, say)."""
    info = path.lstat()
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and info.st_mode & 0o022:
        mode = stat.S_IMODE(info.st_mode)
        try:
            path.chmod(mode & ~0o022)
        except OSError:
            return  # refused below, with the reason
        log.warning(
            "snapshot folder %s was writable by others (mode %o): now %o", path, mode, mode & ~0o022
        )


def parse_labels(text: str, origin: str = "labels") -> dict[str, str]:
    """Parse "k=v,k2=v2" into a dict, rejecting names Prometheus would refuse."""
    labels = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not _valid_label_name(name):
            raise ConfigError(
                f"{origin}: expected name=value with a valid, unreserved label name, got {item!r}"
            )
        labels[name] = value.strip()
    return labels


_RESERVED_LABELS = {
    "device",
    "gpu",
    "gpu_uuid",
    "pool",
    "pid",
    "source",
    "rank",
    "local_rank",
    "pod",
    "namespace",
    "container",
    "instance",
    "job",
}


def _valid_label_name(name: str) -> bool:
    return (
        bool(name)
        and not name.startswith("__")
        and name not in _RESERVED_LABELS
        and (name[0].isalpha() or name[0] == "_")
        and all(c.isalnum() or c == "_" for c in name)
        and name.isascii()
    )


# Settings in seconds, with the range each accepts.
_SECONDS = {
    "remediate_cooldown_s": (0.0, 86400.0),
    "oom_snapshot_cooldown_s": (0.0, 86400.0),
    "empty_cache_cooldown_s": (0.0, 86400.0),
    "process_interval_s": (0.0, 86400.0),
    "layout_interval_s": (0.0, 86400.0),
    "stop_grace_s": (0.0, 3600.0),
    "kubelet_refresh_s": (0.1, 3600.0),
    "kubelet_timeout_s": (0.1, 3600.0),
}


def _token(text: str, origin: str) -> str:
    """A bearer token as the header carries it: surrounding whitespace (a trailing newline
    from `echo`) is dropped; whitespace or control characters inside could never match what
    a client sends. The token itself is never put in the message."""
    token = text.strip()
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"{origin}: the admin token contains whitespace or control characters")
    return token


def _convert(name: str, value: Any, origin: str) -> Any:
    try:
        if name == "admin_token":
            return _token(str(value), origin) or None
        if name == "port":
            port = int(value)
            if not 0 <= port <= 65535:
                raise ValueError
            return port
        if name in ("interval_s", "stale_after_s"):
            number = float(value)
            if not number >= 0 or number > 3600 or (name == "interval_s" and number < 0.01):
                raise ValueError
            return number
        if name in _SECONDS:
            low, high = _SECONDS[name]
            number = float(value)
            if not low <= number <= high:
                raise ValueError
            return number
        if name == "kubelet_resources":
            items = value.split(",") if isinstance(value, str) else list(value)
            names = tuple(str(item).strip() for item in items if str(item).strip())
            for item in names:
                if "/" not in item or any(c.isspace() for c in item):
                    raise ConfigError(
                        f"{origin}: expected device-plugin resource names like "
                        f"example.com/gpu (comma-separated), got {item!r}"
                    )
            return names
        if name == "kubelet_socket":
            text = str(value or "").strip()
            if text and text != "off" and not text.startswith("/"):
                raise ConfigError(
                    f"{origin}: expected an absolute socket path or off, got {value!r}"
                )
            return text
        if name in (
            "snapshot_max_count",
            "snapshot_max_bytes",
            "history_max_entries",
            "layout_max_blocks",
        ):
            number = int(value)
            if number < 0 or (name == "snapshot_max_count" and number < 1):
                raise ValueError
            return number
        if name in (
            "torch",
            "nvml",
            "host_memory",
            "remediate",
            "oom_snapshot",
            "port_per_local_rank",
            "kubelet_pod_reader",
        ):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if name == "labels":
            if isinstance(value, str):
                return parse_labels(value, origin)
            labels = {str(k): str(v) for k, v in dict(value).items()}
            for label in labels:
                if not _valid_label_name(label):
                    raise ConfigError(f"{origin}: invalid or reserved label name {label!r}")
            return labels
        if name == "host":
            host = str(value).strip()
            if host not in ("localhost", "") and not _is_ip(host):
                raise ValueError
            return host or DEFAULT_HOST
        if name == "runbook_url_base" and value not in (None, ""):
            # The page puts it in links: only http(s), never javascript: or a relative path.
            url = str(value).strip()
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.fragment:
                raise ConfigError(
                    f"{origin}: expected an http(s) URL without #fragment, got {value!r}"
                )
            return url
        return None if value in (None, "") else str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        expected = {
            "port": "an integer 0-65535",
            "interval_s": "seconds between 0.01 and 3600",
            "stale_after_s": "seconds between 0 and 3600",
            "remediate_cooldown_s": "seconds between 0 and 86400",
            "oom_snapshot_cooldown_s": "seconds between 0 and 86400",
            "empty_cache_cooldown_s": "seconds between 0 and 86400",
            "process_interval_s": "seconds between 0 and 86400",
            "layout_interval_s": "seconds between 0 and 86400 (0 = off)",
            "layout_max_blocks": "a whole number of blocks",
            "snapshot_max_count": "a whole number of at least 1",
            "snapshot_max_bytes": "a whole number of bytes",
            "history_max_entries": "a whole number (0 = off)",
            "kubelet_refresh_s": "seconds between 0.1 and 3600",
            "stop_grace_s": "seconds between 0 and 3600",
            "kubelet_timeout_s": "seconds between 0.1 and 3600",
            "host": "an IP address or localhost",
        }.get(name, "true or false")
        raise ConfigError(f"{origin}: expected {expected}, got {value!r}") from None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def load_config(env: Mapping[str, str] | None = None, **overrides: Any) -> Config:
    """Defaults, then GPUMEM_* from `env` (os.environ by default), then non-None overrides."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    names = {f.name for f in fields(Config)}
    for name in names:
        key = ENV_PREFIX + name.upper()
        if key in env and env[key] != "":
            values[name] = _convert(name, env[key], key)
            origins[name] = key
    for name, value in overrides.items():
        if name not in names:
            raise ConfigError(f"unknown setting {name!r}")
        if value is not None:
            values[name] = _convert(name, value, name)
            origins[name] = name
    config = Config(**values)
    if config.admin_token_file:
        # A token file that cannot be read at start is a mistake (a wrong path, a Secret not
        # mounted), not a rotation in progress: fail now instead of serving with admin off.
        # An empty one can be a rotation; it keeps the admin API off until it is written.
        try:
            read_token_file(config.admin_token_file)
        except ConfigError as exc:
            raise ConfigError(f"{origins['admin_token_file']}: {exc}") from None
    if config.snapshot_dir:
        try:
            _ = config.snapshot_directory  # a configured folder that is not private fails now
        except ConfigError as exc:
            raise ConfigError(f"{origins['snapshot_dir']}: {exc}") from None
    return config
