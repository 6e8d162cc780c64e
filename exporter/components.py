"""What a server says its GPU memory is for: named components (weights, KV cache, ...).

    with exporter.component("weights"):
        model = load_model().cuda()
    exporter.set_component("kv_cache", kv.numel() * kv.element_size(), device=0)
    exporter.release_component("weights")

`component(name)` (a context manager, also a decorator) keeps, per device, the growth of the
allocator's allocated bytes inside the block as that component: read once on entry and once
on exit, nothing per tick. A component nested in another is taken out of the outer one's
growth, so no byte is counted twice. Frees inside the block that outweigh what it allocated
count as no growth (and are counted, `negative_growth`), never as a negative component. A
server that knows its sizes says them with `set_component`. The ledger (exporter.ledger) lays
the components over the allocator's allocated bytes: where they name more than is still
allocated (their bytes were freed), it caps them, so its sum stays exact.

Bounded: at most MAX_COMPONENTS names per process; what comes under further names is added to
OVERFLOW ("other_named") and counted (`overflowed`), so a server naming one component per
request cannot grow the series.

A component entered again while it is open (two threads loading one model) is not measured
the second time: counted (`reentered`) and said once in the log, never raised into the
server, since a monitoring call must not fail a model load.

Standard library only (torch is found in sys.modules, never imported): agents import this.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from contextlib import ContextDecorator

from exporter.ledger import LEDGER_PARTS
from exporter.probe.allocator import has_context

log = logging.getLogger("exporter")

MAX_COMPONENTS = 16
# What problems() counts (gpumem_exporter_component_problems{problem}).
PROBLEMS = ("overflowed", "negative_growth", "reentered", "open", "pools_refused")
MAX_NAME = 64
# The most bytes a component may say it holds: what the agents' protocol carries (a signed
# 64-bit count), refused at the call rather than by the helper, silently, later.
MAX_BYTES = (1 << 63) - 1
OVERFLOW = "other_named"
# The ledger's own parts (exporter.ledger): no server component may take their names.
RESERVED = frozenset({*LEDGER_PARTS, OVERFLOW})


class ComponentError(ValueError):
    """A component name or use the ledger cannot take (said to the caller at once)."""


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise ComponentError(f"a component is named by 1-{MAX_NAME} characters, not {name!r:.80}")
    if not name.isprintable():
        raise ComponentError(f"component name {name!r:.80} has unprintable characters")
    if name in RESERVED:
        raise ComponentError(f"component name {name!r} is one of the ledger's own parts")
    return name


def _allocated_now() -> dict[int, int]:
    """Allocated bytes of each CUDA device this process initialized; {} before it uses CUDA.
    Never creates a context: a device without one has allocated nothing (it reads 0)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {
        index: int(torch.cuda.memory_allocated(index))
        for index in range(torch.cuda.device_count())
        if has_context(torch, "cuda", index, _WITH_CONTEXT)
    }


# Devices found with a primary context (has_context's cache: torch never tears one down).
_WITH_CONTEXT: set[int] = set()


class Components:
    """The named components of this process, by device; any thread."""

    def __init__(self, allocated: Callable[[], dict[int, int]] = _allocated_now) -> None:
        self._allocated = allocated
        self._lock = threading.Lock()
        self._bytes: dict[str, dict[int, int]] = {}
        self._open: set[str] = set()
        self._stack = threading.local()  # this thread's open blocks, innermost last
        self.overflowed = 0  # names refused a place of their own (their bytes in OVERFLOW)
        self.negative_growth = 0  # blocks whose frees outweighed what they allocated
        self.reentered = 0  # blocks entered while one of the same name was open: not measured
        # Called when a component appears on a device or is released (the agent sends its
        # full sample at the next tick); a new size of one already there goes out with the
        # next periodic full sample instead, so a server setting its KV cache's size at every
        # step does not turn every tick into a full sample.
        self.on_change: list[Callable[[], None]] = []

    def _name_for(self, name: str) -> str:
        """`name`, or OVERFLOW once MAX_COMPONENTS other names hold a place (lock held)."""
        if name in self._bytes or len(self._bytes) < MAX_COMPONENTS:
            return name
        self.overflowed += 1
        return OVERFLOW

    def _changed(self) -> None:
        for listener in list(self.on_change):
            listener()

    def measure(self, name: str) -> _Block:
        return _Block(self, check_name(name))

    def problems(self) -> dict[str, int]:
        """What the ledger could not take as asked, by kind (gpumem_exporter_component_problems)."""
        with self._lock:
            found = {
                "overflowed": self.overflowed,
                "negative_growth": self.negative_growth,
                "reentered": self.reentered,
                "open": len(self._open),
            }
        return {kind: count for kind, count in found.items() if count}

    def _enter(self, block: _Block) -> None:
        with self._lock:
            if block.name in self._open:
                self.reentered += 1
                block.measured = False
                if self.reentered == 1:
                    log.warning(
                        "gpumem-exporter: component %r entered while open; not measured again",
                        block.name,
                    )
                return
            self._open.add(block.name)
        stack = self._blocks()
        block.before = self._allocated()
        block.inner = {}
        stack.append(block)

    def _exit(self, block: _Block) -> None:
        if not block.measured:
            return
        stack = self._blocks()
        after = self._allocated()
        if stack and stack[-1] is block:
            stack.pop()
        growth = {}
        shrank = False
        for device, now in after.items():
            grew = now - block.before.get(device, 0)
            own = grew - block.inner.get(device, 0)  # what nested components took is theirs
            if own < 0:
                shrank = True
            growth[device] = max(own, 0)
            if stack:  # the enclosing block leaves this block's growth to it
                outer = stack[-1].inner
                outer[device] = outer.get(device, 0) + max(grew, 0)
        with self._lock:
            self._open.discard(block.name)
            self.negative_growth += shrank
            held = self._bytes.setdefault(self._name_for(block.name), {})
            new = False
            for device, grew in growth.items():
                if grew:
                    new = new or device not in held
                    held[device] = held.get(device, 0) + grew
        if new:
            self._changed()

    def _blocks(self) -> list[_Block]:
        stack = getattr(self._stack, "blocks", None)
        if stack is None:
            stack = self._stack.blocks = []
        return stack

    def set(self, name: str, nbytes: int, device: int = 0) -> None:
        name = check_name(name)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_BYTES:
            raise ComponentError(
                f"component {name!r}: bytes must be a whole number from 0 to 2**63 - 1"
            )
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ComponentError(f"component {name!r}: device must be an index >= 0")
        with self._lock:
            held = self._bytes.setdefault(self._name_for(name), {})
            new = device not in held
            held[device] = nbytes
        if new:
            self._changed()

    def release(self, name: str) -> None:
        """Forget a component (its bytes are other live memory again, or freed)."""
        with self._lock:
            if name not in self._bytes:
                raise ComponentError(f"no component {name!r} to release")
            del self._bytes[name]
        self._changed()

    def on_device(self, device: int) -> dict[str, int]:
        """Bytes by component name on one device (a copy)."""
        with self._lock:
            return {name: held[device] for name, held in self._bytes.items() if held.get(device)}


class _Block(ContextDecorator):
    """One `with component(name):` (or a function decorated with it)."""

    def __init__(self, components: Components, name: str) -> None:
        self.components = components
        self.name = name
        self.before: dict[int, int] = {}
        self.inner: dict[int, int] = {}
        self.measured = True

    def _recreate_cm(self) -> _Block:
        # A decorated function is a new block at each call (and may run in several threads).
        return _Block(self.components, self.name)

    def __enter__(self) -> _Block:
        self.components._enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.components._exit(self)


@functools.cache
def registry() -> Components:
    """This process's components (one per process; a forked child starts with the parent's)."""
    return Components()


def component(name: str) -> _Block:
    """Count the allocator's growth inside the block as component `name` (see module doc)."""
    return registry().measure(name)


def set_component(name: str, nbytes: int, device: int = 0) -> None:
    registry().set(name, nbytes, device)


def release_component(name: str) -> None:
    registry().release(name)
