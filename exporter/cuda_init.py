"""Run a callback the moment this process initializes CUDA through torch: before the first
allocation that asked for it, so that the OOM observer sees even an OOM in that allocation.

torch.cuda keeps a queue of calls that its lazy initialization runs right after the driver is
up (`torch.cuda._lazy_call`: what torch's own seed and capability checks use), on the thread
that initializes, before that thread's allocation goes on; where CUDA is up already it calls at
once. A process that has not imported torch yet (`exporter.start()` first, or the agent of
`gpumem-exporter run`, which sitecustomize loads before the program) is watched by an import
finder that queues the call as torch.cuda finishes loading, then takes itself off
`sys.meta_path`: until then each import pays one Python call that returns None.

A callback never raises into torch: inside the queue an exception would become torch's
DeferredCudaCallError, and the host's CUDA would not start. Standard library only (the agent
imports this at interpreter start).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger("exporter")

_lock = threading.Lock()
# Each callback, and whether it was called in this process.
_callbacks: list[tuple[Callable[[], None], list[bool]]] = []
# Our one entry is in torch.cuda's queue. The queue outlives a fork, and so does this flag:
# a child forked before its parent initialized CUDA runs the entry at its own init, which
# then calls the child's callbacks.
_queued = False


def on_cuda_init(callback: Callable[[], None]) -> None:
    """Call `callback()` once CUDA is initialized in this process: now, on this thread, if it
    is already; else on the thread that initializes it, inside torch's initialization."""
    with _lock:
        _callbacks.append((callback, [False]))
    cuda = _loaded_torch_cuda()
    if cuda is not None:
        _queue(cuda)
    else:
        _watch_imports()


def forget(callback: Callable[[], None]) -> None:
    """Not to be called any more (a stopped probe)."""
    with _lock:
        _callbacks[:] = [entry for entry in _callbacks if entry[0] != callback]


def _loaded_torch_cuda() -> ModuleType | None:
    """torch.cuda if it has finished loading (its queue exists), else None."""
    cuda = sys.modules.get("torch.cuda")
    if cuda is None or not hasattr(cuda, "_lazy_call") or not hasattr(cuda, "_lazy_init"):
        return None
    return cuda


def _queue(cuda: ModuleType) -> None:
    global _queued
    with _lock:
        if _queued and not _initialized(cuda):
            return  # our entry waits in the queue: it will call the new one too
        # Not queued yet, or it ran already: _lazy_call queues it, or calls it now.
        _queued = True
    # Outside our lock: _lazy_call takes torch's initialization lock, and calls at once
    # (after an initialization in progress on another thread) where CUDA is up.
    try:
        cuda._lazy_call(_initialized_now)
    except Exception as exc:  # a torch without the queue: the agent's tick still arms
        log.debug("torch.cuda's initialization queue is not usable: %s", exc)


def _initialized(cuda: ModuleType) -> bool:
    try:
        return bool(cuda.is_initialized())
    except Exception:
        return False


def _initialized_now() -> None:
    """torch.cuda's queued call: every callback not yet called. Never raises."""
    with _lock:
        due = [callback for callback, ran in _callbacks if not ran[0]]
        for _, ran in _callbacks:
            ran[0] = True
    for callback in due:
        try:
            callback()
        except Exception as exc:  # never into torch's initialization
            log.debug("a callback at CUDA's initialization failed: %s", exc)


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds nothing; on torch.cuda's import, wraps its loader to queue our entry once the
    module has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch.cuda":
            return None
        for finder in list(sys.meta_path):
            if isinstance(finder, _Watcher):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenQueue(spec.loader)
                return spec
        return None


class _ThenQueue(importlib.abc.Loader):
    """torch.cuda's own loader, with our entry queued once the module has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        # The module's loader is its own from here on (inspect, linecache read it).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _stop_watching()
        try:
            _queue(module)
        except Exception as exc:
            log.debug("could not queue the CUDA initialization hook: %s", exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _watch_imports() -> None:
    with _lock:
        if not any(isinstance(f, _Watcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _Watcher())
    # torch.cuda may have finished loading on another thread meanwhile.
    cuda = _loaded_torch_cuda()
    if cuda is not None:
        _stop_watching()
        _queue(cuda)


def _stop_watching() -> None:
    with _lock:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Watcher)]


def _after_fork_in_child() -> None:
    # The child's exporter registers its own callbacks (its probe or agent starts anew).
    global _lock
    _lock = threading.Lock()  # may have been held by another thread at the fork
    _callbacks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
