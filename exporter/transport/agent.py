"""The agent in each serving process: under `gpumem-exporter run` (exporter.run.agent starts
it) and beside exporter.start()'s helper (exporter.helper.link's HelperAgent).

It may be loaded by sitecustomize at interpreter start, so it imports only the standard
library and the allocator source (never torch, never the web stack). It arms what belongs to
the process that owns the allocator (OOM capture, history from start-up, remediation, as the
settings say) the moment this process initializes CUDA (exporter.cuda_init), connects to the
aggregator's Unix socket (in a 0700 folder that only the same user can reach) and sends its
allocator readings every interval. The aggregator's commands run here, through the same
LocalActions an embedded exporter uses. Messages: exporter.transport.protocol.

What a tick costs the serving process is what the probe costs (exporter.probe): the
allocator's C call per device and one packed record each, sent without blocking (a record the
launcher has no room for is dropped and counted, never waited for). The full sample, with what
changes at a slower pace (the GPU's identity, settings, layout, bytes outside the allocator,
OOM verdicts, action counts), is read and sent on the first tick, every `detail_interval_s`,
at once when an allocation retry or an OOM shows in a record or a command has run, and on
every tick where remediation acts on this process's own alerts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter import cuda_init
from exporter.actions.base import ProcessResult, Target
from exporter.actions.spec import BY_NAME, ParamError
from exporter.identity import process_labels
from exporter.probe import record
from exporter.probe.allocator import AllocatorProbe
from exporter.sample import ActionCounts, Sample
from exporter.sigpipe import block_sigpipe_in_this_thread
from exporter.sources import OOM_VERDICTS, provides
from exporter.sources.kinds import allocator_source
from exporter.transport import protocol

if TYPE_CHECKING:
    from exporter.actions.local import LocalActions
    from exporter.config import Config
    from exporter.sampler import Listener

log = logging.getLogger("exporter.agent")

SOCKET_NAME = "aggregator.sock"
CONFIG_NAME = "agent.json"  # the launcher's settings, for the agents (not the admin token)
RECONNECT_S = 5.0
# Sends never raise SIGPIPE: a host that set SIGPIPE back to its default (an embedding C++
# server, a CLI that does so to die quietly in a pipe) would be killed by the kernel when
# the helper's end is closed (helper died or restarted) at the moment this process sends.
# With the flag the send fails with EPIPE, and the agent reconnects.
NO_SIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
RECORD_FLAGS = socket.MSG_DONTWAIT | NO_SIGNAL


def load_agent_config(run_dir: str) -> Config:
    from exporter.config import load_config

    try:
        settings = json.loads((Path(run_dir) / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        settings = {}
    return load_config(env={}, **settings)


class Agent:
    def __init__(
        self,
        run_dir: str | None,
        interval_s: float | None = None,
        *,
        config: Config | None = None,
        on_lost: Callable[[], bool | None] | None = None,
        on_dial: Callable[[str | None], None] | None = None,
    ) -> None:
        """`run_dir`: the folder of the socket (None: not known yet, on_lost finds it).
        `config`: the settings (exporter.start()'s own); else the launcher's settings file.
        `interval_s`: the settings' unless a test asks for another.

        `on_lost()`: called when the socket does not answer: starts the helper again (True),
        finds another process's (False), or finds none (None). `on_dial(refused)`: after a
        try to connect that reached a helper: None if it took this process, else why not."""
        self.socket_path = str(Path(run_dir) / SOCKET_NAME) if run_dir else None
        if config is not None:
            self.config = config
        else:
            try:
                if not run_dir:  # no folder and no settings: never a file of the cwd's
                    raise ValueError("no run folder")
                self.config = load_agent_config(run_dir)
            except Exception:  # the launcher checked them; never fail the host process here
                from exporter.config import Config

                self.config = Config()
        self.interval_s = self.config.interval_s if interval_s is None else interval_s
        # The allocator the settings pick. The agent takes its process's non-allocator bytes
        # itself: the launcher reads NVML at other moments than this process reads its
        # allocator.
        self.source: Any = allocator_source(self.config)
        # The numbers of every tick between full samples (CUDA through torch only).
        self.probe = AllocatorProbe()
        self.detail_interval_s = min(
            self.config.process_interval_s,
            self.config.layout_interval_s or self.config.process_interval_s,
        )
        self._next_full = 0.0  # time.monotonic() of the next full sample; 0: at once
        self._remediating = False  # remediation's detectors see every tick: all full
        self.records_dropped = 0
        self.on_lost = on_lost
        self.on_dial = on_dial
        self.helper_restarts = 0  # helpers this probe started again after one died
        self.records_sent = 0  # with full_samples: what the ticks did (for benchmarks)
        self.full_samples = 0
        self._unsent = b""  # the rest of a record the socket took only part of
        self.actions: LocalActions | None = None
        self._listeners: list[Listener] = []
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._arm_lock = threading.Lock()  # the probe's thread, and the one that starts CUDA
        self._stop = _Stop()
        self._next_connect = 0.0
        self.thread = threading.Thread(target=self._run, name="gpumem-agent", daemon=True)

    def start(self) -> None:
        # Armed the moment CUDA starts, not at the next tick: the OOMs of a server's start-up
        # (its weights, its KV cache sized to what is left, its first allocation) are judged.
        cuda_init.on_cuda_init(self._at_cuda_init)
        self.thread.start()

    def _full_next(self) -> None:
        self._next_full = 0.0

    def _full_now(self) -> None:
        """A verdict is in: the full sample that carries it goes at once, not at the next
        tick (a server whose start-up failed may be about to exit)."""
        self._next_full = 0.0
        self._stop.wake()

    def connect(self) -> bool:
        """Connect now, before start(); False if nothing answers."""
        return self._sock is not None or self._dial()

    def stop(self) -> None:
        self._stop.set()
        cuda_init.forget(self._at_cuda_init)
        sock = self._sock
        if sock is not None:
            # Now, not when the command reader's recv returns: until then the kernel keeps
            # the connection open, and the other end does not see this process leave.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._close()

    def forget(self) -> None:
        """In a forked child: close this copy of the parent's connection, without shutting it
        down (the parent keeps it), so that the other end sees the parent leave when it
        exits; the thread did not survive the fork."""
        self._stop.set()
        cuda_init.forget(self._at_cuda_init)
        self._close()

    # -- the process's own features ------------------------------------------------------

    def _at_cuda_init(self) -> None:
        """On the thread that starts CUDA, inside torch's initialization (exporter.cuda_init):
        this process's features, and the OOM observer attached before the allocation that
        started CUDA goes on."""
        actions = self._arm()
        if actions.oom_capture is not None:
            actions.oom_capture.attach(initializing=True)

    def _arm(self) -> LocalActions:
        """Once this process uses CUDA: its actions, and the features the settings ask for."""
        with self._arm_lock:
            return self._armed()

    def _armed(self) -> LocalActions:
        if self.actions is None:
            from exporter.actions.local import LocalActions
            from exporter.actions.snapshots import SnapshotStore
            from exporter.detectors import Detectors

            config = self.config
            judges_ooms = OOM_VERDICTS in provides(self.source)
            actions = LocalActions(
                SnapshotStore.for_config(config),
                config=config,
                oom_reader=self.source if judges_ooms else None,
                component_problems=getattr(self.source, "component_problems", None),
            )
            # Detection here serves remediation only; the launcher logs alerts for the pod.
            detectors = Detectors(config, log_events=False)
            features = actions.sample_listeners(detectors)
            self._listeners = [detectors, *features] if config.remediate else features
            self._remediating = config.remediate
            # A verdict (or its snapshot) that comes in after the OOM's count went out with a
            # record brings the full sample at the next tick, not 10 s later.
            ooms = getattr(self.source, "ooms", None)
            if ooms is not None:
                ooms.on_change.append(self._full_now)
            # So does a component the server names or releases (exporter.component()).
            components = getattr(self.source, "components", None)
            if components is not None:
                components.on_change.append(self._full_next)
            self.actions = actions
        return self.actions

    def _counts(self) -> ActionCounts:
        counts = self.actions.counts()[0].counts if self.actions is not None else ActionCounts()
        counts.records_dropped = self.records_dropped
        counts.helper_restarts = self.helper_restarts
        return counts

    # -- sending -------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> bool:
        """A whole message, without blocking: False, and dropped (counted with the records),
        where the socket has no room for it now (the helper is stopped or behind). One the
        socket takes in part is finished before anything else is sent: messages stay whole."""
        sock = self._sock
        if sock is None:
            return False
        data = protocol.encode(message)
        with self._send_lock:
            if not self._finish_unsent(sock):
                self.records_dropped += 1
                return False
            try:
                sent = sock.send(data, RECORD_FLAGS)
            except BlockingIOError:
                self.records_dropped += 1
                return False
            if sent < len(data):
                self._unsent = data[sent:]
            return True

    def _finish_unsent(self, sock: socket.socket) -> bool:
        """Send what is left of a message the socket took in part; True once none is left."""
        if self._unsent:
            try:
                sent = sock.send(self._unsent, RECORD_FLAGS)
            except BlockingIOError:
                sent = 0
            self._unsent = self._unsent[sent:]
        return not self._unsent

    def _send_record(self, data: bytes, count: int = 1) -> None:
        """This tick's records, as they are, without blocking: dropped (and counted) where
        the socket has no room, or while part of an earlier one still waits."""
        sock = self._sock
        if sock is None:
            return
        with self._send_lock:
            if not self._finish_unsent(sock):
                self.records_dropped += count
                return
            try:
                sent = sock.send(data, RECORD_FLAGS)
            except BlockingIOError:
                self.records_dropped += count
                return
            self.records_sent += count
            if sent < len(data):
                self._unsent = data[sent:]

    def _close(self) -> None:
        sock, self._sock = self._sock, None
        self._unsent = b""
        self._next_full = 0.0  # a new connection starts with a full sample
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _connect(self) -> bool:
        now = time.monotonic()
        if now < self._next_connect:
            return False
        self._next_connect = now + RECONNECT_S
        if self._dial():
            return True
        found = self.on_lost() if self.on_lost is not None else None
        if found is None:
            return False
        self.helper_restarts += found  # True: this probe started it again
        return self._dial()

    def _dial(self) -> bool:
        refused = self._try_dial()
        if self.on_dial is not None and refused != "":
            self.on_dial(refused)
        sock = self._sock
        if refused is None and sock is not None:
            # Read only once the dial is told: a helper that takes the hello and then says
            # "refused" is heard by this thread, and its refusal told after the success
            # would be undone by it (handle.error None, the refusal logged; CI, 1 run in 3).
            threading.Thread(
                target=self._read, args=(sock,), name="gpumem-agent-commands", daemon=True
            ).start()
        return refused is None

    def _try_dial(self) -> str | None:
        """Connect and say hello: None if it did; "" if nothing listens there (on_lost finds
        or starts a helper); else why the helper did not take this process. Never raises
        (start() calls it on the host's thread)."""
        if self.socket_path is None:
            return ""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            return ""
        self._sock = sock
        try:
            said_hello = self._send(protocol.hello(process_labels()))
        except OSError:
            said_hello = False
        if not said_hello:
            said = _refusal(sock)
            self._close()
            return f"the helper did not take this process: {said}"
        return None  # _dial starts the reader

    def tick(self) -> None:
        """The probe's records, or the full sample where one is due. (At 1 Hz a tick runs
        on cold caches: every function it calls costs microseconds, hence one short path.)"""
        if self._sock is None or time.monotonic() >= self._next_full or self._remediating:
            self._full_tick()
            return
        records = self.probe.records()
        if not records or self.probe.moved:
            self._full_tick()  # a retry or an OOM: its layout and verdict now, not later
            return
        if len(records) == 1:
            self._send_record(records[0])
        else:  # one send for all devices
            self._send_record(b"".join(records), len(records))

    def _before_cuda(self) -> None:
        """A tick before this process uses CUDA: nothing to say (under `run` the launcher
        serves the process once it reports a GPU). exporter.helper.link's agent says it lives."""

    def _other_end_left(self, sock: socket.socket) -> None:
        """The aggregator closed `sock` (it left). `run`'s launcher outlives its agents: the
        reader just ends. exporter.helper.link's agent finds or starts a helper again."""

    def _full_tick(self) -> None:
        reading = self.source.read()  # empty until this process uses CUDA
        if not reading.allocators:
            self._before_cuda()
            return
        self._arm()
        sample = Sample(timestamp=time.time(), allocators=reading.allocators)
        for listener in self._listeners:
            try:
                listener(sample)
            except Exception as exc:  # a feature failing must not stop the readings
                log.debug("agent listener failed: %s", exc)
        if self._sock is None and not self._connect():
            return
        pinned = reading.pinned_host[0] if reading.pinned_host else None
        allocators = [protocol.allocator_fields(a) for a in reading.allocators]
        if not self._send(protocol.sample(allocators, self._counts(), pinned)):
            return  # no room: the next tick sends one, the ticks between read nothing
        self.full_samples += 1
        wait = self.detail_interval_s
        # A process that has just started may have no value for its bytes outside the
        # allocator yet (NVML did not list it, or memory moved across the list's read): the
        # next full sample comes when that value is to be read again, not 10 s later.
        retry_s = self.source.non_allocator_retry_s()
        if retry_s is not None:
            wait = min(wait, max(retry_s, self.interval_s))
        self._next_full = time.monotonic() + wait
        self.probe.expect(
            {
                a.device: (
                    a.counters.get("alloc_retries", record.ABSENT),
                    a.counters.get("ooms", record.ABSENT),
                )
                for a in reading.allocators
            }
        )
        settings = self.source.allocator_settings()
        if settings is not None:
            self.probe.configure(*settings)

    def _run(self) -> None:
        block_sigpipe_in_this_thread()  # finding or restarting the helper (HTTP) runs here
        while not self._stop.sleep(self.interval_s):
            try:
                self.tick()
            except OSError:
                self._close()  # the aggregator went away; retry later
            except Exception as exc:  # never let the agent disturb its host
                log.debug("agent tick failed: %s", exc)

    # -- commands ------------------------------------------------------------------------

    def _read(self, sock: socket.socket) -> None:
        block_sigpipe_in_this_thread()  # the actions' threads, started from here, too
        reader = protocol.StreamReader()
        # Waits in poll() for input only, not in recv(): a recv() blocked on a Unix socket
        # wakes each time the other end takes what this process sent (the kernel's
        # write-space wake-up), so this thread would run once per record, 19 us a time on
        # an H100 host (0.19 ms/s at 10 Hz); poll() wakes only for what it asked for.
        waiting = select.poll()
        waiting.register(sock, select.POLLIN)
        while True:
            try:
                waiting.poll()
                chunk = sock.recv(65536)
            except OSError:
                return
            if not chunk:
                self._other_end_left(sock)
                return
            try:
                for line in reader.feed(chunk):
                    message = protocol.decode(line)
                    if message.get("type") == "command":
                        threading.Thread(target=self._execute, args=(message,), daemon=True).start()
                    elif message.get("type") == "refused":
                        self._refused(sock, str(message.get("reason", ""))[:200])
                        return
            except protocol.ProtocolError as exc:
                log.debug("bad message from the aggregator: %s", exc)
                return

    def _refused(self, sock: socket.socket, reason: str) -> None:
        """The helper did not take this process: said (on the handle), and tried again at
        the next connect."""
        if self._sock is sock:
            self._close()
        if self.on_dial is not None:
            self.on_dial(f"the helper did not take this process: {reason or 'no reason given'}")

    def _execute(self, message: dict[str, Any]) -> None:
        try:
            request_id, action, params = protocol.parse_command(message)
        except protocol.ProtocolError as exc:
            log.debug("bad command: %s", exc)
            return
        try:
            # Checked again here: the launcher may be another version than this agent.
            checked = BY_NAME[action].check(params)
            result = self._arm().perform(action, Target(), checked)[0]
        except ParamError as exc:
            result = ProcessResult(process_labels(), False, error=str(exc), outcome="invalid")
        except Exception as exc:  # a bug: answer it rather than leave the launcher waiting
            result = ProcessResult(
                process_labels(), False, error=f"{type(exc).__name__}: {exc}", outcome="error"
            )
        self._full_next()  # the counts the action changed go out with the next tick
        try:
            self._send(protocol.reply(request_id, result))
        except OSError:
            self._close()


def _refusal(sock: socket.socket) -> str:
    """Why the helper closed a new connection, if it said so before closing."""
    try:
        for line in protocol.StreamReader().feed(sock.recv(4096, socket.MSG_DONTWAIT)):
            message = protocol.decode(line)
            if message.get("type") == "refused":
                return str(message.get("reason", ""))[:200]
    except (OSError, protocol.ProtocolError):
        pass
    return "it closed the connection at once"


class _Stop:
    """The probe thread's sleep between ticks, ended at once by set(): a held lock's timed
    acquire, one C call. (threading.Event.wait makes and queues a lock in Python at every
    wait: 60 against 47 us of CPU a wake-up, at 1 Hz beside a busy asyncio loop on an H200,
    `python -m bench.wakeups`; a tick at 1 Hz is ~140 us.)"""

    def __init__(self) -> None:
        self._held = threading.Lock()
        self._held.acquire()
        self._set = False

    def sleep(self, seconds: float) -> bool:
        """Sleep `seconds`, or until wake(); True (at once) once set() was called."""
        if self._set:
            return True
        # Taken when set() or wake() released it: held again, as the next sleep needs it.
        self._held.acquire(True, seconds)
        return self._set

    def set(self) -> None:
        self._set = True
        self.wake()

    def wake(self) -> None:
        """End the sleep under way (or the next one) now; it says whether set() was called."""
        with contextlib.suppress(RuntimeError):  # released already (woken twice)
            self._held.release()
