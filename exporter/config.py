"""One config object, filled from defaults, then `GPUMEM_*` environment, then explicit values.

Explicit values are CLI flags or keyword arguments to `exporter.start()`. Invalid values raise
ConfigError with a one-line message naming the setting and where it came from.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import stat
import tempfile
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from exporter.catalog import DETAIL_LEVELS

DEFAULT_PORT = 9445
DEFAULT_HOST = "127.0.0.1"
ENV_PREFIX = "GPUMEM_"

log = logging.getLogger("exporter.config")


class ConfigError(ValueError):
    """A setting is invalid; str() is a one-line message for the user."""


@dataclass(frozen=True)
class Setting:
    """What a Config field is to its users: its help, how its text or value is checked, and
    where it goes. Its name, type and default are the field's own; its variable is
    GPUMEM_<NAME> and its flag --<name-with-dashes> (exporter.cli)."""

    help: str
    # (value, origin) -> the value; ConfigError in one line naming the origin
    parse: Callable[[Any, str], Any]
    flag: bool = True  # offered by the commands that serve (never for a secret)
    agents: bool = True  # handed to the agents of `gpumem-exporter run` (agent.json)
    default_text: str = ""  # the default in words, where the value alone says too little

    def env(self, name: str) -> str:
        return ENV_PREFIX + name.upper()


def setting(
    default: Any,
    help: str,
    parse: Callable[[Any, str], Any],
    *,
    flag: bool = True,
    agents: bool = True,
    secret: bool = False,
    default_text: str = "",
) -> Any:
    """A Config field declared with everything its users need (Setting)."""
    declared = Setting(help, parse, flag and not secret, agents and not secret, default_text)
    metadata = {"setting": declared}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata, repr=not secret)


# -- checks: each takes the value (text from the environment or a flag, or a Python value)
# and where it came from, and says what it expected in one line.


def _expected(what: str) -> Callable[[Callable[[Any], Any]], Callable[[Any, str], Any]]:
    """Turn a conversion that raises TypeError/ValueError into a check with this message."""

    def wrap(convert: Callable[[Any], Any]) -> Callable[[Any, str], Any]:
        def check(value: Any, origin: str) -> Any:
            try:
                return convert(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{origin}: expected {what}, got {value!r}") from None

        return check

    return wrap


def _seconds(low: float, high: float, note: str = "") -> Callable[[Any, str], Any]:
    @_expected(f"seconds between {low:g} and {high:g}{note}")
    def convert(value: Any) -> float:
        number = float(value)
        if not low <= number <= high:  # also refuses nan
            raise ValueError
        return number

    return convert


def _whole(minimum: int, what: str) -> Callable[[Any, str], Any]:
    @_expected(what)
    def convert(value: Any) -> int:
        number = int(value)
        if number < minimum:
            raise ValueError
        return number

    return convert


@_expected("true or false")
def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError


@_expected("an integer 0-65535")
def _port(value: Any) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError
    return port


@_expected("an IP address or localhost")
def _host(value: Any) -> str:
    host = str(value).strip()
    if host not in ("localhost", "") and not _is_ip(host):
        raise ValueError
    return host or DEFAULT_HOST


def _text(value: Any, origin: str) -> str | None:
    return None if value in (None, "") else str(value)


def _admin_token(value: Any, origin: str) -> str | None:
    return _token(str(value), origin) or None


def _labels(value: Any, origin: str) -> dict[str, str]:
    if isinstance(value, str):
        return parse_labels(value, origin)
    labels = {str(k): str(v) for k, v in dict(value).items()}
    for label in labels:
        if not _valid_label_name(label):
            raise ConfigError(f"{origin}: invalid or reserved label name {label!r}")
    return labels


def _kubelet_socket(value: Any, origin: str) -> str:
    text = str(value or "").strip()
    if text and text != "off" and not text.startswith("/"):
        raise ConfigError(f"{origin}: expected an absolute path or off, got {value!r}")
    return text


def _resources(value: Any, origin: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(item).strip() for item in items if str(item).strip())
    for item in names:
        if "/" not in item or any(c.isspace() for c in item):
            raise ConfigError(
                f"{origin}: expected device-plugin resource names like example.com/gpu "
                f"(comma-separated), got {item!r}"
            )
    return names


def _http_url(value: Any, origin: str) -> str | None:
    if value in (None, ""):
        return None
    # The page puts it in links: only http(s), never javascript: or a relative path.
    url = str(value).strip()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.fragment:
        raise ConfigError(f"{origin}: expected an http(s) URL without #fragment, got {value!r}")
    return url


def _admin_auth(value: Any, origin: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    methods = tuple(dict.fromkeys(str(i).strip().lower() for i in items if str(i).strip()))
    if not methods or set(methods) - {"token", "kubernetes"}:
        raise ConfigError(
            f"{origin}: expected token, kubernetes or token,kubernetes, got {value!r}"
        )
    return methods


def _choice(*choices: str) -> Callable[[Any, str], Any]:
    @_expected(" or ".join(choices))
    def convert(value: Any) -> str:
        text = str(value).strip()
        if text not in choices:
            raise ValueError
        return text

    return convert


_COOLDOWN = _seconds(0.0, 86400.0)


def _between(low: float, high: float, what: str) -> Callable[[Any, str], Any]:
    @_expected(f"{what} between {low:g} and {high:g}")
    def convert(value: Any) -> float:
        number = float(value)
        if not low <= number <= high:  # also refuses nan
            raise ValueError
        return number

    return convert


# The in-process alerts' thresholds (exporter.alerts declares which alert reads which). The
# rules in deploy/prometheus/alerts.yaml carry the same defaults (a test holds them equal):
# a threshold changed here for one server is changed there for its rules too.
_SHARE = _between(0.0, 1.0, "a share")
_BYTES = _between(0.0, float(1 << 50), "bytes")
_HOLD = _seconds(0.0, 86400.0)  # how long a condition holds before its alert fires
_WINDOW = _seconds(1.0, 86400.0)  # a window a rate or trend is read over


@_expected(" or ".join(DETAIL_LEVELS))
def _detail(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in DETAIL_LEVELS:
        raise ValueError
    return text


@dataclass(frozen=True)
class Config:
    """Every setting, declared once: name, type and default here, the rest in its Setting
    (help, check, flag, whether agents get it). Environment, flags, exporter.start()'s
    keywords, the agents' settings file and docs/settings.md all come from these fields."""

    host: str = setting(
        DEFAULT_HOST,
        "address to listen on (0.0.0.0 in containers)",
        _host,
        agents=False,
    )
    port: int = setting(DEFAULT_PORT, "port to listen on", _port, agents=False)
    health_port: int = setting(
        0,
        "serve and demo: a second port, plain HTTP, that answers only /healthz and /readyz "
        "(0 = none), for the kubelet's probes where the main port asks for a client "
        "certificate",
        _port,
        agents=False,
    )
    interval_s: float = setting(1.0, "seconds between samples", _seconds(0.01, 3600.0))
    labels: dict[str, str] = setting(  # noqa: RUF009 - a field with a default_factory
        {}, "constant labels on every series, e.g. model=llama3,tier=prod", _labels
    )
    stale_after_s: float = setting(
        0.0,
        "seconds after which a sample is stale and /healthz answers 503",
        _seconds(0.0, 3600.0),
        default_text="0: max(3 intervals, 5 s)",
    )
    port_per_local_rank: bool = setting(
        False,
        "one exporter per rank without `gpumem-exporter run`: listen on port + LOCAL_RANK",
        _boolean,
    )
    helper_dir: str | None = setting(
        None,
        "folder where exporter.start()'s helper keeps its socket folder (one per user and port): "
        "a volume shared with a helper sidecar in Kubernetes",
        _text,
        default_text="the temp dir",
        agents=False,
    )
    helper_spawn: bool = setting(
        True,
        "whether exporter.start() starts the helper when none serves its port (off: a sidecar "
        "runs it; the probe waits for it)",
        _boolean,
        agents=False,
    )
    detail: str = setting(
        "basic",
        "which families to serve: basic keeps a fleet's series budget (about 40 per GPU at a "
        "server, 10 at the node daemon); full adds per-pool, private-pool, per-pid and driver "
        "breakdowns (docs/metrics.md, Detail levels)",
        _detail,
        agents=False,
    )
    torch: bool = setting(True, "read PyTorch's caching allocator", _boolean)
    allocator_api: str = setting(
        "cuda",
        "how the allocator is read: cuda (torch.cuda: with its layout, OOM verdicts, memory "
        "cap and pinned host memory) or accelerator (torch.accelerator, for ROCm, XPU and "
        "other devices: the allocator's numbers only)",
        _choice("cuda", "accelerator"),
    )
    nvml: bool = setting(True, "read NVML (device and per-process GPU memory)", _boolean)
    host_memory: bool = setting(True, "read host memory (/proc/meminfo)", _boolean)
    process_interval_s: float = setting(
        10.0,
        "seconds between reads of NVML's per-process list, its costliest read (device memory "
        "is read every tick); a serving process reads its own entry (its bytes outside the "
        "allocator) every 6 x this while the GPU's used memory and its reserved stand exactly "
        "still",
        _COOLDOWN,
    )
    # The layout comes from a snapshot, which stalls the serving thread ~0.7 us per block
    # (docs/performance.md).
    layout_interval_s: float = setting(
        10.0,
        "seconds between allocator snapshots behind the largest free block and private pools",
        _seconds(0.0, 86400.0, " (0 = off)"),
    )
    layout_max_blocks: int = setting(
        10_000,
        "no allocator snapshot above this many blocks (it would stall the serving thread)",
        _whole(0, "a whole number of blocks"),
    )
    kubelet_socket: str = setting(
        "",
        "the kubelet's pod-resources socket for pod attribution (node daemon), or off",
        _kubelet_socket,
        default_text="/var/lib/kubelet/pod-resources/kubelet.sock where this runs in "
        "Kubernetes or that socket exists",
    )
    kubelet_refresh_s: float = setting(
        10.0,
        "seconds between Lists of the kubelet's pod-resources API (and at once when GPU "
        "processes change)",
        _seconds(0.1, 3600.0),
    )
    kubelet_timeout_s: float = setting(
        5.0, "deadline of each call to the kubelet", _seconds(0.1, 3600.0)
    )
    kubelet_resources: tuple[str, ...] = setting(
        (),
        "device-plugin resource names (and DRA driver names) besides nvidia.com/gpu, "
        "nvidia.com/mig-* and gpu.nvidia.com (comma-separated; a trailing * matches a prefix)",
        _resources,
    )
    kubelet_container_logs: str = setting(
        "/var/log/containers",
        "the kubelet's container log links, which name each GPU process's pod and container "
        "from its cgroup without the Kubernetes API (node daemon), or off",
        _kubelet_socket,
    )
    kubelet_pod_reader: bool = setting(
        False,
        "read this node's pods from the Kubernetes API (needs RBAC: the chart's podReader), "
        "so that processes on shared GPUs are named",
        _boolean,
    )
    kubelet_claim_reader: bool = setting(
        False,
        "read the ResourceClaims of this node's DRA devices from the Kubernetes API (needs "
        "RBAC: the chart's claimReader), so that GPU memory a claim consumed of a shared GPU "
        "is held against what its processes use",
        _boolean,
    )
    stop_grace_s: float = setting(
        10.0,
        "`run`: seconds between SIGTERM and SIGKILL for what is left of the command's process "
        "tree when it ends or the launcher is stopped",
        _seconds(0.0, 3600.0),
    )
    remediate: bool = setting(
        False,
        "automatic remediation: empty_cache on retries with high fragmentation, a snapshot on "
        "the first OOM",
        _boolean,
    )
    remediate_cooldown_s: float = setting(
        300.0, "least seconds between two automatic remediations", _COOLDOWN
    )
    snapshot_dir: str | None = setting(
        None,
        "folder of the snapshots, this user's alone",
        _text,
        default_text="<tmp>/gpumem-snapshots-<uid>",
    )
    snapshot_max_count: int = setting(
        20, "snapshots kept, oldest removed first", _whole(1, "a whole number of at least 1")
    )
    snapshot_max_bytes: int = setting(
        2 << 30, "bytes of snapshots kept", _whole(0, "a whole number of bytes")
    )
    history_max_entries: int = setting(
        0,
        "record allocation history from start-up, bounded to this many entries (0 = off)",
        _whole(0, "a whole number (0 = off)"),
    )
    oom_snapshot: bool = setting(
        True,
        "write an allocator snapshot (without history unless it is being recorded) at an OOM, "
        "at most one per cooldown; every OOM gets its verdict either way",
        _boolean,
    )
    oom_snapshot_cooldown_s: float = setting(
        60.0, "least seconds between two OOM snapshots", _COOLDOWN
    )
    empty_cache_cooldown_s: float = setting(
        10.0, "least seconds between two POST /empty-cache calls", _COOLDOWN
    )
    admin_token: str | None = setting(
        None, "the admin API's bearer token (prefer a token file)", _admin_token, secret=True
    )
    admin_token_file: str | None = setting(
        None,
        "file holding the admin API's bearer token, read again on every request",
        _text,
        agents=False,
    )
    admin_auth: tuple[str, ...] = setting(
        ("token",),
        "how admin callers prove who they are: token (the shared admin token), kubernetes "
        "(their bearer token checked with the API server's TokenReview and the action with "
        "SubjectAccessReview), or both, comma-separated",
        _admin_auth,
        agents=False,
    )
    admin_kubernetes_authorization: str = setting(
        "namespace",
        "what RBAC is asked for an admin action with admin_auth kubernetes: namespace (verb on "
        "gpumem-exporter/<resource> in this pod's namespace) or nodes/proxy (like the "
        "kubelet's API, for the node daemon)",
        _choice("namespace", "nodes/proxy"),
        agents=False,
    )
    kubernetes_service_account_dir: str = setting(
        "/var/run/secrets/kubernetes.io/serviceaccount",
        "folder of the token, ca.crt and namespace used to call the Kubernetes API (pod reader, "
        "admin identities)",
        _text,
        agents=False,
    )
    web_config_file: str | None = setting(
        None,
        "web config file in exporter-toolkit's format (TLS, client certificates, basic auth, "
        "response headers, rate limit; docs/deploy.md), read again when it or its files change",
        _text,
        agents=False,
    )
    allow_cleartext_admin: bool = setting(
        False,
        "accept admin credentials over plain HTTP from other hosts (without TLS they cross the "
        "network readable; loopback clients, kubectl port-forward included, are always accepted)",
        _boolean,
        agents=False,
    )
    runbook_url_base: str | None = setting(
        None,
        "where the live page's alert links point (+ #<alert>), e.g. your fork's docs/runbooks.md",
        _http_url,
        default_text="the copy served at /runbooks",
    )
    # -- in-process alerts (exporter.alerts): each is read by the alerts that name it --------
    detect_fragmentation_ratio: float = setting(
        0.3, "GpuMemFragmentationHigh: inactive split bytes over reserved above this", _SHARE
    )
    detect_fragmentation_min_reserved_bytes: float = setting(
        float(1 << 30),
        "GpuMemFragmentationHigh: only with more than this reserved",
        _BYTES,
        default_text="1 GiB",
    )
    detect_fragmentation_for_s: float = setting(
        600.0, "GpuMemFragmentationHigh: seconds the condition holds before it fires", _HOLD
    )
    detect_counter_window_s: float = setting(
        600.0,
        "GpuMemAllocRetries, GpuMemOutOfMemory, GpuMemOomFragmentation, "
        "GpuMemAllocatorSettingsChanged: firing while the counter rose within this many seconds",
        _WINDOW,
    )
    detect_cache_gap_bytes: float = setting(
        float(4 << 30),
        "GpuMemCacheGapHigh: reserved minus allocated above this",
        _BYTES,
        default_text="4 GiB",
    )
    detect_cache_gap_ratio: float = setting(
        0.5, "GpuMemCacheGapHigh: and that gap over reserved above this", _SHARE
    )
    detect_cache_gap_for_s: float = setting(
        1800.0, "GpuMemCacheGapHigh: seconds the condition holds before it fires", _HOLD
    )
    detect_shattered_block_share: float = setting(
        0.25,
        "GpuMemFreeCacheShattered: the largest free block under this share of the default "
        "pool's free bytes, and the GPU's room (or the cap's) under it too",
        _SHARE,
    )
    detect_shattered_min_free_bytes: float = setting(
        float(2 << 30),
        "GpuMemFreeCacheShattered: only with more than this free",
        _BYTES,
        default_text="2 GiB",
    )
    detect_shattered_for_s: float = setting(
        900.0, "GpuMemFreeCacheShattered: seconds the condition holds before it fires", _HOLD
    )
    detect_headroom_free_ratio: float = setting(
        0.05, "GpuMemHeadroomLow: the GPU's free share under this", _SHARE
    )
    detect_headroom_for_s: float = setting(
        600.0, "GpuMemHeadroomLow: seconds the condition holds before it fires", _HOLD
    )
    detect_exhaustion_free_ratio: float = setting(
        0.2, "GpuMemExhaustionPredicted: the GPU's free share under this", _SHARE
    )
    detect_exhaustion_horizon_s: float = setting(
        3600.0, "GpuMemExhaustionPredicted: free memory reaches zero within this", _WINDOW
    )
    detect_exhaustion_window_s: float = setting(
        600.0, "GpuMemExhaustionPredicted: the trend is fitted over this many seconds", _WINDOW
    )
    detect_exhaustion_for_s: float = setting(
        900.0, "GpuMemExhaustionPredicted: seconds the condition holds before it fires", _HOLD
    )
    detect_host_available_ratio: float = setting(
        0.05, "HostMemoryPressure: available host memory's share under this", _SHARE
    )
    detect_host_for_s: float = setting(
        300.0, "HostMemoryPressure: seconds the condition holds before it fires", _HOLD
    )
    detect_swap_min_used_bytes: float = setting(
        float(1 << 30),
        "HostSwapGrowing: only with more swap in use than this",
        _BYTES,
        default_text="1 GiB",
    )
    detect_swap_growth_bytes_per_s: float = setting(
        float(256 * 1024),
        "HostSwapGrowing: swap growing faster than this",
        _BYTES,
        default_text="256 KiB/s",
    )
    detect_swap_window_s: float = setting(
        900.0, "HostSwapGrowing: the growth is fitted over this many seconds", _WINDOW
    )
    detect_swap_for_s: float = setting(
        300.0, "HostSwapGrowing: seconds the condition holds before it fires", _HOLD
    )
    detect_host_process_share: float = setting(
        0.5,
        "HostMemoryHeldByProcess: one process resident above this share of the memory in use",
        _SHARE,
    )
    detect_host_process_available_ratio: float = setting(
        0.1, "HostMemoryHeldByProcess: while available host memory is under this share", _SHARE
    )
    detect_host_process_for_s: float = setting(
        120.0, "HostMemoryHeldByProcess: seconds the condition holds before it fires", _HOLD
    )
    detect_clear_margin: float = setting(
        0.2,
        "every in-process alert clears only once its value is this much (a share of the "
        "threshold) on the safe side: a value hovering at a threshold does not flap",
        _between(0.0, 0.99, "a share"),
    )

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

    def admin_methods_ready(self) -> tuple[str, ...]:
        """The methods of admin_auth that have what they need to identify a caller: "token"
        with a token or a token file, "kubernetes" (the API server decides) always. The one
        rule for "admin has credentials": the web config's basic auth lets such callers
        through with their own credentials, and gpumem_exporter_web_info says them."""
        return tuple(
            method
            for method in self.admin_auth
            if method != "token" or self.admin_token or self.admin_token_file
        )

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
        text = read_small_file(path, MAX_TOKEN_FILE_BYTES, "a token").decode()
        if server:
            _warn_if_world_readable(path)
    except OSError as exc:
        raise ConfigError(f"cannot read admin token file {name}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"admin token file {name} is not text") from None
    return _token(text, f"admin token file {name}")


MAX_TOKEN_FILE_BYTES = 64 * 1024


def read_small_file(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """A regular file's bytes, at most `limit` (`what` it would be, for the error). Opened
    without blocking and checked before reading: a FIFO would hang start-up (and every
    request) and /dev/zero would never end; OSError with a one-line strerror otherwise
    (IsADirectoryError for a folder)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(mode):
            raise OSError(0, "not a regular file")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(0, f"larger than {limit // 1024} KiB: not {what}")
    return data


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


def _token(text: str, origin: str) -> str:
    """A bearer token as the header carries it: surrounding whitespace (a trailing newline
    from `echo`) is dropped; whitespace or control characters inside could never match what
    a client sends. The token itself is never put in the message."""
    token = text.strip()
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"{origin}: the admin token contains whitespace or control characters")
    return token


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in fields(Config)}
# Settings never written down or shown (a token): they travel in the environment only.
SECRETS = frozenset(f.name for f in fields(Config) if not f.repr)


def public_settings(config: Config) -> dict[str, Any]:
    """The settings as JSON values, secrets left out: what a helper runs with (its folder's
    helper.json), and what /stats says is in force."""
    values = {name: getattr(config, name) for name in SETTINGS if name not in SECRETS}
    loaded: dict[str, Any] = json.loads(json.dumps(values, default=str))
    return loaded


def default_text(name: str) -> str:
    """A setting's default in words, for help and docs."""
    declared, value = SETTINGS[name], DEFAULTS[name]
    if declared.default_text:
        return declared.default_text
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in (None, (), {}):
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


_DEFAULT = Config()
DEFAULTS = {f.name: getattr(_DEFAULT, f.name) for f in fields(Config)}


def load_config(
    env: Mapping[str, str] | None = None,
    *,
    flags: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Config:
    """Defaults, then GPUMEM_* from `env` (os.environ by default: the one place the settings'
    variables are read), then non-None `overrides` (exporter.start()'s keywords, the agents'
    file), then non-None command-line `flags`, each by its name."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    given = [(name, value, name) for name, value in overrides.items()]
    given += [(name, value, "--" + name.replace("_", "-")) for name, value in (flags or {}).items()]
    for name, declared in SETTINGS.items():
        key = declared.env(name)
        if env.get(key, "") != "":
            values[name], origins[name] = declared.parse(env[key], key), key
    for name, value, origin in given:
        if name not in SETTINGS:
            raise ConfigError(f"unknown setting {name!r}")
        if value is not None:
            values[name], origins[name] = SETTINGS[name].parse(value, origin), origin
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


def markdown_table() -> str:
    """Every setting as one row, for docs/settings.md (written by exporter.reference)."""
    rows = [
        "| setting | variable | flag | default | agents of `run` | what it does |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, declared in SETTINGS.items():
        flag = f"`--{name.replace('_', '-')}`" if declared.flag else "none (a secret)"
        cells = (
            f"`{name}`",
            f"`{declared.env(name)}`",
            flag,
            default_text(name),
            "yes" if declared.agents else "no",
            declared.help.replace("|", "\\|"),
        )
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
