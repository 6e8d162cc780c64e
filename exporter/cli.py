"""The `gpumem-exporter` command: serve (node daemon), demo (replay), record.

Errors a user can fix (bad flags, a taken port, an unreadable trace) end with one line on
stderr and exit status 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import ssl
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import ParseResult, urlparse

from exporter import atomic
from exporter.actions.base import Target
from exporter.actions.spec import (
    EMPTY_CACHE,
    HISTORY_STATUS,
    RESET_PEAK,
    SET_HISTORY,
    SNAPSHOT,
    Action,
)
from exporter.answers import human_answer, terminal_safe
from exporter.config import (
    DEFAULTS,
    SETTINGS,
    Config,
    ConfigError,
    default_text,
    load_config,
    read_token_file,
)
from exporter.http.server import ServerStartError
from exporter.identity import describe_process
from exporter.runtime import build_runtime, sources_for
from exporter.sources import Source
from exporter.trace import TraceError, TraceWriter
from exporter.version import __version__

if TYPE_CHECKING:
    from exporter.client import AdminClient

log = logging.getLogger("exporter")


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Every setting but secrets, as declared (exporter.config.Config): --<name> TEXT, checked
    as its variable is, and winning over it."""
    group = parser.add_argument_group(
        "settings", "each also read from its GPUMEM_ variable; a flag wins over the variable"
    )
    for name, declared in SETTINGS.items():
        if declared.flag:
            group.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                metavar=_METAVARS.get(name, _metavar(name)),
                help=f"{declared.help} (default {default_text(name)}) [{declared.env(name)}]",
            )


def _metavar(name: str) -> str:
    kind = type(DEFAULTS[name])
    return "SECONDS" if name.endswith("_s") else {bool: "on|off", int: "N"}.get(kind, "VALUE")


_METAVARS = {
    "host": "ADDRESS",
    "port": "PORT",
    "labels": "NAME=VALUE,...",
    "snapshot_dir": "DIR",
    "admin_token_file": "FILE",
    "kubelet_socket": "PATH",
    "kubelet_resources": "NAMES",
    "runbook_url_base": "URL",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpumem-exporter",
        description="Prometheus exporter for PyTorch's CUDA caching allocator, NVML and host "
        "memory. In a PyTorch server call exporter.start(); these commands run it "
        "standalone.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="least severe log messages printed on stderr (default INFO)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (
        _add_serve_command,
        _add_demo_command,
        _add_record_command,
        _add_run_command,
        _add_snapshot_command,
        _add_empty_cache_command,
        _add_history_command,
        _add_reset_peak_command,
        _add_stats_command,
        _add_why_command,
        _add_view_command,
        _add_hash_password_command,
    ):
        add(commands)
    return parser


def _add_serve_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="node daemon: NVML device and per-process memory, host memory",
        description="Serve NVML (all visible GPUs, per-process memory) and host memory on "
        "/metrics. Needs no torch; for unmodified or non-Python servers.",
    )
    _add_server_flags(serve)


def _add_demo_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        "demo",
        help="replay a trace recorded on a real GPU, no GPU needed",
        description="Serve the metrics of a recorded trace at the pace it was recorded, "
        "looping. Without --trace, plays the trace shipped with the package "
        "(an H100 serving a decoder with dynamic batching under a 22 GiB memory cap: it "
        "fragments its cache, retries allocations and runs out of memory).",
    )
    _add_server_flags(demo)
    demo.add_argument(
        "--trace", type=Path, help="trace file made by `record` or exporter.start(record_to=...)"
    )
    demo.add_argument(
        "--snapshots",
        type=Path,
        help="folder of snapshots recorded with the trace (scripts/record_demo_trace.py "
        "--snapshots); the demo answers snapshot actions from it (the packaged one for the "
        "packaged trace; without it another trace has none)",
    )
    demo.add_argument(
        "--no-loop", action="store_true", help="play the trace once, then hold its last sample"
    )
    demo.add_argument(
        "--speed", type=float, default=1.0, help="playback speed (default 1: the recorded pace)"
    )


def _add_record_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    record = commands.add_parser(
        "record",
        help="record a running exporter's metrics into a trace file",
        description="Scrape a running exporter's /metrics every interval and write the "
        "samples to a trace that `demo --trace FILE` replays. The file is a loadable trace "
        "of every sample so far at any moment. A target that stops answering (3 failed "
        "scrapes in a row) ends the recording early, keeping its samples: exit 0 whenever "
        "samples were kept, 2 when none were.",
    )
    record.add_argument(
        "--url", required=True, help="exporter base URL or /metrics URL, e.g. http://127.0.0.1:9445"
    )
    record.add_argument("-o", "--output", required=True, type=Path, help="trace file to write")
    record.add_argument("--duration-s", type=float, required=True, help="how long to record")
    record.add_argument(
        "--interval-s", type=float, default=1.0, help="seconds between scrapes (default 1)"
    )
    _add_transport_flags(record)


def _add_run_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = commands.add_parser(
        "run",
        help="run a server with every Python process it starts instrumented",
        description="Start CMD with the exporter injected into every Python process it "
        "spawns (through sitecustomize on PYTHONPATH), and serve one /metrics for "
        "all of them, each process's series labelled with pid, rank, local_rank "
        "and role. The launcher owns CMD's process tree: signals go to all of it, orphans "
        "are reaped, and whatever is left when CMD ends or the launcher is stopped gets "
        "SIGTERM, then SIGKILL after --stop-grace-s; the exit status is CMD's.",
        usage="gpumem-exporter run [options] -- CMD [ARGS...]",
    )
    _add_server_flags(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to run, after --")


def _add_snapshot_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    snapshot = commands.add_parser(
        "snapshot",
        help="capture an allocator snapshot from a running exporter",
        description="POST /snapshot to a running exporter (optionally recording allocation "
        "history for --record-s seconds first) and download the pickle. Under "
        "`gpumem-exporter run` each process of the server (or the one chosen with "
        "--pid/--rank) gives one file: OUTPUT.pid<PID>.pickle, or into OUTPUT if it is a "
        "directory.",
    )
    _add_client_flags(snapshot)
    snapshot.add_argument(
        "-o", "--output", required=True, type=Path, help="snapshot pickle (or a directory)"
    )
    window = snapshot.add_mutually_exclusive_group()
    _add_action_options(window, SNAPSHOT, "record_s")
    window.add_argument(
        "--stop",
        action="store_true",
        help="end the --record-s capture that is recording now and download what it recorded",
    )
    window.add_argument(
        "--id",
        metavar="ID",
        help="download a snapshot the exporter keeps (GET /snapshots lists them) instead of "
        "taking one",
    )
    window.add_argument(
        "--latest-oom",
        action="store_true",
        help="download the newest snapshot taken at an OOM (of the process --pid/--rank "
        "chooses) instead of taking one",
    )
    _add_action_options(snapshot, SNAPSHOT, "stacks", "max_entries")


def _add_empty_cache_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    empty_cache = _add_action_command(
        commands, EMPTY_CACHE, "ask a running exporter to release cached GPU memory"
    )
    _add_action_options(empty_cache, EMPTY_CACHE)


def _add_history_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    history = commands.add_parser(
        "history",
        help="start, stop or show allocation history recording",
        description="GET/POST /history: record allocation history (bounded) so that later "
        "snapshots show what allocated what. Stopping takes a snapshot first (PyTorch "
        "clears the buffer when recording stops).",
    )
    history.add_argument(
        "state",
        choices=["start", "stop", "status"],
        help="start recording, stop it (a snapshot is taken first), or show whether it records",
    )
    _add_client_flags(history)
    _add_action_options(history, SET_HISTORY, "max_entries", "stacks")


def _add_reset_peak_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    reset_peak = _add_action_command(commands, RESET_PEAK, "reset the allocator's peak statistics")
    _add_action_options(reset_peak, RESET_PEAK)


def _add_action_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], action: Action, summary: str
) -> argparse.ArgumentParser:
    """A command that runs one declared action (exporter.actions.spec): named and described
    after it."""
    parser = commands.add_parser(
        action.name.replace("_", "-"),
        help=summary,
        description=f"{action.method} {action.path}: {action.help}",
    )
    _add_client_flags(parser)
    return parser


def _add_action_options(
    parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup,
    action: Action,
    *names: str,
) -> None:
    """The declared parameters of `action` that have a flag (all, or those named), with the
    declaration's type, choices and help; bounds are checked after parsing (_act)."""
    for param in action.params:
        if not param.flag or (names and param.name not in names):
            continue
        default = "" if param.default is None else f" (default {param.default})"
        parser.add_argument(
            param.flag,
            dest=param.name,
            type=param.kind,
            choices=param.choices or None,
            metavar="N" if param.kind is int else None,
            help=param.help[0].lower() + param.help[1:].rstrip(".") + default,
        )


def _add_stats_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    stats = commands.add_parser(
        "stats",
        help="print the latest sample and firing alerts as JSON",
        description="GET /stats: the exporter's latest sample and its firing in-process alerts.",
    )
    _add_client_flags(stats)


def _add_why_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    why = commands.add_parser(
        "why",
        help="why each process ran out of GPU memory: the latest OOM's verdict and action",
        description="GET /stats: per process and device, the OOMs counted by verdict and the "
        "latest one's verdict (fragmentation, pools, cap, other_processes, outside_allocator, "
        "exhaustion, unknown), the "
        "numbers that decided it, what to do, and the snapshot taken at it.",
    )
    _add_client_flags(why)


def _add_view_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    view = commands.add_parser(
        "view",
        help="render a snapshot as a self-contained HTML page (works offline)",
        description="Render an allocator snapshot (pickle, optionally gzipped) as one HTML "
        "page that loads nothing from the network.",
    )
    view.add_argument(
        "snapshot",
        help="snapshot pickle, or a snapshot's URL on an exporter "
        "(http://POD:9445/snapshots/ID, as GET /snapshots and the live page list them; the "
        "admin token from --token-file or GPUMEM_ADMIN_TOKEN_FILE/GPUMEM_ADMIN_TOKEN)",
    )
    view.add_argument(
        "-o",
        "--output",
        type=Path,
        help="HTML file to write (default: the snapshot's name with .html, beside it; for a "
        "URL, ID.html here)",
    )
    view.add_argument("--token-file", type=Path, help="file holding the admin bearer token")
    _add_transport_flags(view)


def _add_transport_flags(parser: argparse.ArgumentParser) -> None:
    """How to reach an exporter whose web config asks for TLS, a client certificate or
    basic auth (docs/deploy.md)."""
    parser.add_argument(
        "--ca-file", type=Path, help="CA certificates that signed the exporter's (https URLs)"
    )
    parser.add_argument("--cert", type=Path, help="client certificate to show (with --key)")
    parser.add_argument("--key", type=Path, help="the client certificate's key")
    parser.add_argument(
        "--user",
        help="basic auth user of the exporter's web config; the password comes from "
        "--password-file, else GPUMEM_PASSWORD",
    )
    parser.add_argument("--password-file", type=Path, help="file holding the --user's password")


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        required=True,
        help="the exporter, as for `record`: its base URL or its /metrics URL, e.g. "
        "http://127.0.0.1:9445",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help="file holding the admin bearer token [GPUMEM_ADMIN_TOKEN_FILE]. The token comes "
        "from --token-file, else from the file named by GPUMEM_ADMIN_TOKEN_FILE, else from "
        "GPUMEM_ADMIN_TOKEN (the token itself): a token file wins over a token, as on the "
        "server. With none, requests go without a token (the demo and servers with admin "
        "open to loopback need none)",
    )
    parser.add_argument(
        "--kubeconfig-token",
        action="store_true",
        help="send the current kubeconfig user's token (an exporter with admin_auth "
        "kubernetes checks it with the API server; RBAC decides)",
    )
    _add_transport_flags(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the exporter's answer as JSON (for scripts) instead of lines for people",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="how long to wait for the exporter (default 60)",
    )
    parser.add_argument(
        "--pid", type=int, help="only this process (under gpumem-exporter run; host PID)"
    )
    parser.add_argument(
        "--rank", type=int, help="only the process with this RANK (under gpumem-exporter run)"
    )


def _config(args: argparse.Namespace) -> Config:
    try:
        flags = {name: getattr(args, name) for name, d in SETTINGS.items() if d.flag}
        config = load_config(flags=flags)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    return config


def _writable(path: Path, flag: str, *, folder_ok: bool = False) -> None:
    """Check a file the command will write before the exporter is asked for anything: an
    answer (a snapshot taken) must never be lost to a path that cannot be written."""
    if path.is_dir() and not folder_ok:
        raise CliError(f"{flag} {path} is a directory; name a file")
    folder = path if path.is_dir() else path.parent
    if not folder.is_dir():
        raise CliError(f"output directory does not exist: {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CliError(f"cannot write in {folder}: permission denied or a read-only disk")


def _serve(config: Config, sources: Sequence[Source], mode: str) -> int:
    runtime = build_runtime(config, mode=mode, sources=sources)
    try:
        http = runtime.server()
        health = runtime.health_server()
    except ServerStartError as exc:
        raise CliError(str(exc)) from None
    # uvicorn shuts down on SIGTERM, then raises it again with the handler it found: this one
    # ends the process as a normal exit, so that finally blocks and atexit run (the demo's
    # snapshot folder is removed) instead of the default handler killing it.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    runtime.sampler.start()
    log.info(
        "gpumem-exporter %s (%s) serving %s/metrics, live page at %s/",
        __version__,
        mode,
        http.url,
        http.url,
    )
    if health is not None:
        health.start()
        log.info("health checks (/healthz, /readyz) also at %s", health.url)
    try:
        http.run()
    finally:
        if health is not None:
            health.stop()
        runtime.sampler.stop()
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def cmd_serve(args: argparse.Namespace) -> int:
    config = _config(args)
    return _serve(config, sources_for("node", config), "node")


def cmd_demo(args: argparse.Namespace) -> int:
    from exporter.sources.replay import ReplaySource

    config = _config(args)
    if args.trace is not None and not args.trace.is_file():
        raise CliError(f"trace file not found: {args.trace}")
    if not 0.01 <= args.speed <= 1000:
        raise CliError("--speed must be between 0.01 and 1000")
    if args.snapshots is not None and not (args.snapshots / "index.json").is_file():
        raise CliError(f"--snapshots: no index.json in {args.snapshots}")
    try:
        replay = ReplaySource(
            args.trace, loop=not args.no_loop, speed=args.speed, snapshots=args.snapshots
        )
    except TraceError as exc:
        raise CliError(str(exc)) from None
    meta = replay.meta
    log.info(
        "replaying %s: %s, %.0f s per loop",
        replay.path,
        meta.get("description", "recorded trace"),
        replay.duration_s,
    )
    return _serve(config, [replay], "demo")


def _exporter_url(url: str) -> ParseResult:
    """--url, parsed: http(s)://HOST[:PORT][/...], or HOST:PORT meaning http:// (as curl and
    Prometheus's targets take it). A URL that cannot be parsed is a one-line error."""
    if "://" not in url and url.strip():
        url = "http://" + url.strip()
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 - parsing the port raises on a bad one
    except ValueError as exc:
        raise CliError(f"--url {url!r} is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise CliError(f"--url must be an http(s) URL, got {url!r}")
    return parsed


def _metrics_url(url: str) -> str:
    parsed = _exporter_url(url)
    url = parsed.geturl()
    return url if parsed.path.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def cmd_run(args: argparse.Namespace) -> int:
    from exporter.run.launcher import run

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise CliError("no command to run: gpumem-exporter run [options] -- CMD [ARGS...]")
    config = _config(args)
    try:
        return run(command, config)
    except ServerStartError as exc:
        raise CliError(str(exc)) from None


def cmd_record(args: argparse.Namespace) -> int:
    """Exit 0 whenever samples were kept, also when the target stopped answering before the
    end (that is often the incident being recorded: the line on stderr says so); 2 when
    nothing was recorded. The file is a loadable trace of every sample so far at any moment,
    so a recorder that is killed keeps its samples too."""
    from exporter.record import RecordError, TargetStopped, record_url

    url = _metrics_url(args.url)
    context, basic = _transport(args)
    if not args.duration_s > 0:
        raise CliError("--duration-s must be positive")
    if not 0.05 <= args.interval_s <= 3600:
        raise CliError("--interval-s must be between 0.05 and 3600")
    _writable(args.output, "-o")
    try:
        writer = TraceWriter(
            args.output,
            meta={"recorded_by": "gpumem-exporter record", "source_url": url},
            live=True,
            private=False,  # the user's own file, named by them: their umask, like `> FILE`
        )
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    stopped = error = None
    try:
        record_url(
            url,
            writer,
            duration_s=args.duration_s,
            interval_s=args.interval_s,
            context=context,
            headers={"Authorization": basic} if basic else None,
        )
    except TargetStopped as exc:
        stopped = str(exc)
    except RecordError as exc:
        error = str(exc)
    except KeyboardInterrupt:
        pass  # keep what was recorded so far
    finally:  # whatever ended the recording, even a bug, the samples so far stay
        count = writer.count
        if count:
            path = writer.close()
        else:
            writer.abort()
    if not count:
        raise CliError(error or "no samples recorded")
    if stopped is not None:
        print(f"gpumem-exporter record: {stopped}; kept {count} samples in {path}", file=sys.stderr)
    else:
        print(f"recorded {count} samples to {path}")
    return 0


def _transport(args: argparse.Namespace) -> tuple[ssl.SSLContext | None, str | None]:
    """The TLS context (https URLs) and basic auth header the transport flags ask for."""
    from exporter.client import ClientError, basic_authorization, tls_context

    if (args.cert is None) != (args.key is None):
        raise CliError("--cert and --key go together")
    context = None
    if _exporter_url(args.url).scheme == "https":
        try:
            context = tls_context(args.ca_file, args.cert, args.key)
        except ClientError as exc:
            raise CliError(str(exc)) from None
    elif args.ca_file or args.cert:
        raise CliError("--ca-file, --cert and --key need an https:// --url")
    if args.user is None:
        if args.password_file is not None:
            raise CliError("--password-file needs --user")
        return context, None
    if args.password_file is not None:
        try:
            password = args.password_file.read_text().rstrip("\r\n")
        except OSError as exc:
            raise CliError(
                f"--password-file: cannot read {args.password_file}: {exc.strerror}"
            ) from None
    elif "GPUMEM_PASSWORD" in os.environ:
        password = os.environ["GPUMEM_PASSWORD"]
    else:
        raise CliError("--user needs --password-file or GPUMEM_PASSWORD")
    return context, basic_authorization(args.user, password)


def _client(args: argparse.Namespace) -> AdminClient:
    from exporter.client import AdminClient, ClientError, kubeconfig_token

    if args.kubeconfig_token and args.token_file is not None:
        raise CliError("--kubeconfig-token and --token-file: give one")
    if args.kubeconfig_token:
        try:
            token: str | None = kubeconfig_token(os.environ)
        except ClientError as exc:
            raise CliError(str(exc)) from None
    else:
        token = _admin_token(args.token_file, os.environ)
    parsed = _exporter_url(args.url)
    if parsed.query or parsed.fragment or parsed.path.rstrip("/") not in ("", "/metrics"):
        raise CliError(f"--url must be the exporter's base or /metrics URL, got {args.url!r}")
    base = parsed._replace(path="").geturl()
    if not 0 < args.timeout_s <= 86400:  # also refuses nan and inf
        raise CliError("--timeout-s must be a number of seconds between 0 and 86400")
    context, basic = _transport(args)
    return AdminClient(base, token, timeout_s=args.timeout_s, context=context, basic=basic)


def _admin_token(token_file: Path | None, env: Mapping[str, str]) -> str | None:
    """The client's token, by the server's precedence (exporter.config): a token file over a
    token, the command line over the environment. A named file that is unreadable or empty
    is an error, never a silent fall back to the next source."""
    if token_file is not None:
        name, origin = str(token_file), "--token-file"
    elif env.get("GPUMEM_ADMIN_TOKEN_FILE"):
        name, origin = env["GPUMEM_ADMIN_TOKEN_FILE"], "GPUMEM_ADMIN_TOKEN_FILE"
    elif env.get("GPUMEM_ADMIN_TOKEN"):
        return env["GPUMEM_ADMIN_TOKEN"]  # as the server takes it (exporter.config)
    else:
        return None  # none configured: asked without one; a server that wants one says so
    try:
        token = read_token_file(name, server=False)
    except ConfigError as exc:
        raise CliError(f"{origin}: {exc}") from None
    if not token:
        raise CliError(f"{origin}: admin token file {name} is empty")
    return token


def _target(args: argparse.Namespace) -> Target:
    if args.pid is not None and args.pid < 1:
        raise CliError("--pid must be a positive process id")
    if args.rank is not None and args.rank < 0:
        raise CliError("--rank must be 0 or more")
    return Target(args.pid, args.rank)


def _failures(answer: dict[str, Any]) -> int:
    """One line on stderr per process the action failed in; exit status 2 if any did."""
    failed = [p for p in answer.get("processes", []) if not p.get("ok")]
    for entry in failed:
        line = f"{describe_process(entry.get('process') or {})}: {entry.get('error')}"
        print(terminal_safe(line, newlines=False), file=sys.stderr)
    return 2 if failed else 0


def _report(args: argparse.Namespace, answer: dict[str, Any]) -> int:
    """Print an action's answer (as JSON with --json, else one line per process and
    value), then its failures."""
    if args.json:
        print(json.dumps(answer, indent=2))  # ensure_ascii: no control character goes out raw
        return _failures(answer)
    with _shape_checked("the action's answer"):
        print(terminal_safe(human_answer(answer)), end="")
        return _failures(answer)


@contextlib.contextmanager
def _shape_checked(what: str) -> Iterator[None]:
    """An answer of a shape no exporter gives is one line, never a traceback (round 4: 15
    malformed /stats answers ended in one under `why`)."""
    try:
        yield
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise CliError(
            f"{what} has a shape no exporter gives ({type(exc).__name__}): not an exporter's"
        ) from None


def _check_flags(action: Action, **params: Any) -> None:
    """A parameter out of its declared bounds is a one-line error naming its flag, before
    the exporter is asked anything."""
    for name, value in params.items():
        problem = action.param(name).problem(value) if value is not None else ""
        if problem:
            raise CliError(f"{action.param(name).flag or name} {problem}")


def _act(args: argparse.Namespace, action: Action, **params: Any) -> dict[str, Any]:
    """Run a declared action in the selected processes."""
    _check_flags(action, **params)
    client = _client(args)
    answer: dict[str, Any] = _client_call(args, lambda target: client.act(action, target, **params))
    return answer


def _client_call(args: argparse.Namespace, call: Callable[[Target], Any]) -> Any:
    from exporter.client import ClientError

    try:
        return call(_target(args))
    except ClientError as exc:
        raise CliError(str(exc)) from None


def _output_path(output: Path, process: dict[str, str], filename: str, several: bool) -> Path:
    if output.is_dir():
        return output / filename
    if not several:
        return output
    return output.with_name(f"{output.stem}.pid{process.get('pid', 'x')}{output.suffix}")


def cmd_snapshot(args: argparse.Namespace) -> int:
    from exporter.client import ClientError

    _check_flags(SNAPSHOT, record_s=args.record_s, stacks=args.stacks, max_entries=args.max_entries)
    _writable(args.output, "-o", folder_ok=True)
    client = _client(args)
    if args.id is not None or args.latest_oom:
        return _download_kept(args, client)
    if args.stop:
        answer = _client_call(args, client.stop_capture)
    else:
        answer = _client_call(
            args,
            lambda target: client.snapshot(
                target, record_s=args.record_s, stacks=args.stacks, max_entries=args.max_entries
            ),
        )
    entries = answer.get("processes", [])
    replay = " (replay of recorded data)" if answer.get("replay") else ""
    written = []
    for entry in entries:
        if not entry["ok"] or entry["result"] is None:  # failed, or was not recording
            continue
        info = entry["result"]
        path = _output_path(args.output, entry["process"], info["filename"], len(entries) > 1)
        try:
            size = client.download(info["id"], path)
        except ClientError as exc:
            raise CliError(str(exc)) from None
        except OSError as exc:
            raise CliError(
                f"cannot write {path}: {exc.strerror or exc} (snapshot {info['id']} is kept "
                "by the exporter: GET /snapshots to fetch it)"
            ) from None
        written.append({**info, "process": entry["process"], "path": str(path), "bytes": size})
        if not args.json:
            print(
                f"snapshot {info['id']} of {describe_process(entry['process'])}{replay}: "
                f"{size} bytes written to {path}"
            )
    if args.json:
        print(json.dumps({"replay": bool(answer.get("replay")), "written": written}, indent=2))
    return _failures(answer)


def _download_kept(args: argparse.Namespace, client: AdminClient) -> int:
    """`snapshot --id ID` / `--latest-oom`: one snapshot the exporter already keeps."""
    from exporter.actions.snapshots import ID_PATTERN
    from exporter.client import ClientError

    if args.stacks is not None or args.max_entries is not None:
        raise CliError("--stacks and --max-entries shape a new snapshot: not with --id")
    if args.id is not None and not ID_PATTERN.fullmatch(args.id):
        raise CliError(f"--id {args.id!r}: not a snapshot id (like 20261127T220259Z-1a2b3c4d)")
    listed = _client_call(args, client.list_snapshots)
    if args.id is not None:
        found = [info for info in listed if info["id"] == args.id]
        missing = f"no snapshot {args.id} among the {len(listed)} this exporter keeps"
    else:
        found = [info for info in listed if info.get("trigger") == "oom"]  # newest first
        missing = f"no snapshot taken at an OOM among the {len(listed)} this exporter keeps"
    if not found:
        raise CliError(missing)
    info = found[0]
    if info.get("status") != "ready":
        status = terminal_safe(str(info.get("status")), newlines=False)
        raise CliError(f"snapshot {info['id']} is {status}: nothing to download yet")
    path = _output_path(args.output, {}, info["filename"], several=False)
    try:
        size = client.download(info["id"], path)
    except ClientError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from None
    meta = info.get("meta")
    process = meta.get("process") if isinstance(meta, dict) else None
    if args.json:
        print(json.dumps({"written": [{**info, "path": str(path), "bytes": size}]}, indent=2))
    else:
        of = f" of {describe_process(process)}" if isinstance(process, dict) and process else ""
        line = f"snapshot {info['id']}{of} ({info.get('trigger')}): {size} bytes written to {path}"
        print(terminal_safe(line, newlines=False))
    return 0


def cmd_empty_cache(args: argparse.Namespace) -> int:
    return _report(args, _act(args, EMPTY_CACHE, device=args.device))


def cmd_history(args: argparse.Namespace) -> int:
    if args.state == "status":
        return _report(args, _act(args, HISTORY_STATUS))
    enabled = args.state == "start"
    return _report(
        args,
        _act(args, SET_HISTORY, enabled=enabled, max_entries=args.max_entries, stacks=args.stacks),
    )


def cmd_reset_peak(args: argparse.Namespace) -> int:
    return _report(args, _act(args, RESET_PEAK, device=args.device))


def cmd_stats(args: argparse.Namespace) -> int:
    stats = _client_call(args, _client(args).stats)
    try:
        print(json.dumps(stats, indent=2))  # a sample is data: JSON either way
    except RecursionError:  # nested deeper than json's encoder goes: no exporter's answer
        raise CliError("GET /stats: the answer nests too deeply: not an exporter's") from None
    return 0


def cmd_why(args: argparse.Namespace) -> int:
    client = _client(args)
    stats = _client_call(args, client.stats)
    with _shape_checked("GET /stats"):
        _print_why(args, stats, client.base_url)
    return 0


def _print_why(args: argparse.Namespace, stats: dict[str, Any], base_url: str) -> None:
    from exporter.answers import ledger_answer, oom_answer

    if args.json:
        verdicts = [
            {
                "process": a.get("process") or {},
                "device": a.get("device"),
                "ooms": (a.get("counters") or {}).get("ooms", 0),
                "ooms_by_verdict": a.get("ooms_by_verdict") or {},
                "last_oom": a.get("last_oom"),
            }
            for a in (stats.get("sample") or {}).get("allocators", [])
        ]
        ledgers = stats.get("ledgers") or []
        print(
            json.dumps(
                {"mode": stats.get("mode"), "devices": verdicts, "ledgers": ledgers}, indent=2
            )
        )
    else:
        print(terminal_safe(oom_answer(stats, base_url) + ledger_answer(stats)), end="")


# A snapshot on an exporter: BASE/snapshots/ID, or its /view or /info page.
_SNAPSHOT_URL = re.compile(r"(?P<base>.*?)/snapshots/(?P<id>[^/?#]+)(?:/view|/info)?/?")


def _fetched_snapshot(args: argparse.Namespace, url: str, folder: Path) -> tuple[Path, str]:
    """`view URL`: the snapshot downloaded into `folder` (private, temporary), and its id."""
    from exporter.actions.snapshots import ID_PATTERN
    from exporter.client import ClientError

    found = _SNAPSHOT_URL.fullmatch(url)
    if found is None or not ID_PATTERN.fullmatch(found["id"]):
        raise CliError(f"{url!r} is not a snapshot's URL (http://HOST:PORT/snapshots/ID)")
    args.url, args.kubeconfig_token, args.timeout_s = found["base"], False, 60.0
    path = folder / f"{found['id']}.pickle"
    try:
        _client(args).download(found["id"], path)
    except ClientError as exc:
        raise CliError(str(exc)) from None
    return path, found["id"]


def cmd_view(args: argparse.Namespace) -> int:
    import tempfile

    from exporter.viewer import SnapshotError, load_snapshot, render_html

    with tempfile.TemporaryDirectory(prefix="gpumem-view-") as folder:
        if "://" in args.snapshot:
            path, snapshot_id = _fetched_snapshot(args, args.snapshot, Path(folder))
            if args.output is None:
                args.output = Path(f"{snapshot_id}.html")
            source = args.snapshot
        else:
            path = Path(args.snapshot)
            source = str(path)
        try:
            snapshot = load_snapshot(path)
        except SnapshotError as exc:
            raise CliError(str(exc)) from None
    if args.output is None:  # snap.pickle(.gz) -> snap.html, beside it
        name = path.name.removesuffix(".gz").removesuffix(".pickle")
        args.output = path.with_name((name or path.name) + ".html")
    _writable(args.output, "-o")
    try:
        html = render_html(
            snapshot,
            title=f"GPU memory snapshot {path.name}",
            meta={"file" if source == str(path) else "url": source},
        )
    except SnapshotError as exc:  # over the viewer's limits: too large to draw
        raise CliError(f"{source}: {exc}") from None
    # The user's own file, named by them: their umask, like `> FILE` (snapshots stay 0600).
    try:
        atomic.write_bytes(args.output, html.encode("utf-8"), private=False)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {args.output}")
    return 0


def _add_hash_password_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    hashing = commands.add_parser(
        "hash-password",
        help="bcrypt hash of a password for the web config's basic_auth_users (htpasswd -B)",
        description="Read a password (asked twice on a terminal, else the first line of "
        "stdin; never an argument, which `ps` shows) and print its bcrypt hash for "
        "basic_auth_users in the web config file or the chart's web.basicAuth.users.",
    )
    hashing.add_argument(
        "--cost",
        type=int,
        default=10,
        help="bcrypt cost, 10 to 16 (default 10: ~70 ms a check, once per user and password)",
    )


# Below 10 a stolen hash falls too fast; above 16 each first check takes seconds.
HASH_COSTS = range(10, 17)


def cmd_hash_password(args: argparse.Namespace) -> int:
    import getpass

    import bcrypt

    if args.cost not in HASH_COSTS:
        raise CliError(f"--cost: expected {HASH_COSTS.start} to {HASH_COSTS.stop - 1}")
    if sys.stdin.isatty():
        password = getpass.getpass("Password: ")
        if getpass.getpass("Again: ") != password:
            raise CliError("the passwords differ")
    else:
        password = sys.stdin.readline().removesuffix("\n").removesuffix("\r")
    if not password:
        raise CliError("an empty password")
    encoded = password.encode()
    if len(encoded) > 72:  # bcrypt reads 72 bytes: the rest would not count
        raise CliError("a password of more than 72 bytes (bcrypt ignores the rest)")
    print(bcrypt.hashpw(encoded, bcrypt.gensalt(args.cost)).decode())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    handlers = {
        "serve": cmd_serve,
        "demo": cmd_demo,
        "record": cmd_record,
        "snapshot": cmd_snapshot,
        "run": cmd_run,
        "empty-cache": cmd_empty_cache,
        "history": cmd_history,
        "reset-peak": cmd_reset_peak,
        "stats": cmd_stats,
        "why": cmd_why,
        "view": cmd_view,
        "hash-password": cmd_hash_password,
    }
    if args.command not in handlers:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handlers[args.command](args)
    except (CliError, ConfigError) as exc:
        message = terminal_safe(str(exc), newlines=False)  # it may quote a server's answer
        print(f"gpumem-exporter {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
