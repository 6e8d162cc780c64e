"""Reading a snapshot file safely: a restricted unpickler, bounded in size, objects and keys.

A snapshot may be an upload from an untrusted source and pickle can run code, so only the
types a snapshot holds are built, and work and memory are bounded by the limits below, not by
the size of the file; what is over them is refused with a SnapshotError.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import IO, Any, ClassVar

from exporter.units import fmt_bytes as _fmt_bytes

NO_HISTORY_MESSAGE = (
    "no allocation history was recorded: enable it with POST /history or record_s=N"
)

# -- limits ----------------------------------------------------------------------------------
# A pickle memoizes: an object written once can be referenced again for a few bytes, so a file
# of a few hundred KiB can name one big segment ten thousand times, or a tuple whose hash
# takes hours to compute. Every step below is therefore bounded by what it does, not by the
# size of the file, and each bound is far above what a real snapshot needs (the figures are
# from snapshots captured on an H100 with torch 2.11; docs/reliability.md has them).

# Uncompressed pickle bytes. A snapshot with 50k live blocks and the default history of 100k
# entries is 11 MB; with 1M entries and C++ stacks (stacks="all") it is 125 MB.
MAX_SNAPSHOT_BYTES = 256 << 20
# Containers, strings, big ints and memo entries the unpickler may create: a 16 MB file of 8M
# memoized empty dicts (30 KB gzipped), just under this, loads in 1.2 GB. The 125 MB snapshot
# above needs 7.6M and 1.1 GB.
MAX_PICKLE_OBJECTS = 16_000_000
# Segments, blocks and history entries the viewer walks, counted each time they are reached:
# a list referenced twice costs twice. Each costs about 3 us and 170 bytes, so this bounds a
# render at about 6 s and 350 MB. The 50k-block snapshot needs 0.16M, the 125 MB one 1.06M
# (history is at most 1M entries: max_entries is capped there).
MAX_RENDER_ITEMS = 2_000_000
# Stack frames of live blocks walked, counted the same way; each costs about 0.1 us (frames
# are shared, and parsed once). The 125 MB snapshot needs 1.65M; 50k live blocks with
# 60-frame C++ and Python stacks would need 3M.
MAX_RENDER_FRAMES = 10_000_000
# Characters of the page; the biggest real snapshots make pages of about 2 MB.
MAX_PAGE_CHARS = 32 << 20
# Distinct devices; a process sees the GPUs of one host.
MAX_DEVICES = 64
# Characters kept of any one text (file name, function name, setting); demangled C++ names
# reach about 1000.
MAX_TEXT_CHARS = 2000


class SnapshotError(ValueError):
    """The file is not a readable allocator snapshot; str() is a one-line reason."""


# -- loading ---------------------------------------------------------------------------------
# A snapshot is built from dicts, lists, tuples, str, int, float, bool and None, which pickle
# encodes with opcodes of its own: the demo snapshot (protocol 4) needs no global at all.
# Older protocols encode sets and bytes through callables, and a snapshot that passed through
# other tools may hold an OrderedDict; each is allowed through a stand-in that checks and
# counts its argument. Everything else (os.system, builtins.eval, copyreg._reconstructor,
# torch classes) is refused.

INT_LIMIT = 1 << 64  # addresses, sizes, streams and times all fit in 64 bits
_KEY_TYPES = frozenset({str, bytes, int, float, bool, type(None)})


def _check_keys(keys: Iterable[Any]) -> None:
    """Dict keys and set items must hash in constant time and without chosen collisions.

    A tuple's hash is not cached: a tuple nested 40 deep through the memo takes 2**40 steps
    to hash, and tuples of ints can be made to collide at will. Strings and bytes hash with a
    random seed; ints are limited to 64 bits, so that at most 16 of them share a hash.
    """
    kinds = set(map(type, keys))
    if kinds <= {str}:  # every key of every dict torch writes
        return
    if not kinds <= _KEY_TYPES:
        bad = sorted(k.__name__ for k in kinds - _KEY_TYPES)
        raise SnapshotError(f"refusing a dict key or set item of type {bad[0]}")
    if int in kinds and any(type(k) is int and not -INT_LIMIT < k < INT_LIMIT for k in keys):
        raise SnapshotError("refusing a dict key or set item: an integer beyond 64 bits")


class _SnapshotUnpickler(pickle._Unpickler):
    """pickle's Python unpickler with hooks where work could outgrow the file.

    The C unpickler is 5 to 20 times faster but offers no hook between opcodes, so nothing
    could stop it hashing a hostile key. Here dict keys and set items are checked before they
    are hashed, and every container, string and memo entry is counted.
    """

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # set by load(): the items since the last MARK

    def __init__(self, file: IO[bytes], max_objects: int) -> None:
        super().__init__(file)
        self.objects_left = max_objects
        self.max_objects = max_objects

    def spend(self, n: int) -> None:
        self.objects_left -= n
        if self.objects_left < 0:
            raise SnapshotError(
                f"more than {self.max_objects:,} containers, strings and references "
                "to unpickle: not an allocator snapshot, or one far larger than any seen"
            )

    def find_class(self, module: str, name: str) -> Any:
        # Protocols 0-2 name the builtins module as Python 2 did.
        module = "builtins" if module == "__builtin__" else module
        stand_in = _STAND_INS.get((module, name))
        if stand_in is None:
            raise SnapshotError(
                f"refusing to unpickle {module}.{name}: an allocator snapshot holds only plain "
                "dicts, lists and numbers"
            )
        return lambda *args: stand_in(self, *args)

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotError("refusing a pickle with persistent ids: not an allocator snapshot")


def _counted(load: Any) -> Any:
    def counted(self: _SnapshotUnpickler) -> None:
        self.spend(1)
        load(self)

    return counted


def _keys_checked(load: Any, keys_of: Any) -> Any:
    # In the Python unpickler MARK starts a fresh self.stack, so after a mark the items of
    # SETITEMS, DICT, ADDITEMS and FROZENSET are all of self.stack.
    def checked(self: _SnapshotUnpickler) -> None:
        _check_keys(keys_of(self.stack))
        load(self)

    return checked


def _install_hooks(dispatch: dict[int, Any]) -> None:
    for op in (
        pickle.EMPTY_DICT, pickle.EMPTY_LIST, pickle.EMPTY_SET, pickle.DICT, pickle.LIST,
        pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.FROZENSET,
        pickle.MEMOIZE, pickle.PUT, pickle.BINPUT, pickle.LONG_BINPUT,
        pickle.SHORT_BINUNICODE, pickle.BINUNICODE, pickle.BINUNICODE8, pickle.UNICODE,
        pickle.STRING, pickle.BINSTRING, pickle.SHORT_BINSTRING,
        pickle.SHORT_BINBYTES, pickle.BINBYTES, pickle.BINBYTES8, pickle.BYTEARRAY8,
        pickle.LONG, pickle.LONG1, pickle.LONG4,
    ):  # fmt: skip
        dispatch[op[0]] = _counted(dispatch[op[0]])
    keys_at = {
        pickle.SETITEM: lambda stack: stack[-2:-1],  # ... key value SETITEM
        pickle.SETITEMS: lambda stack: stack[0::2],  # MARK key value key value ... SETITEMS
        pickle.DICT: lambda stack: stack[0::2],
        pickle.ADDITEMS: lambda stack: stack,
        pickle.FROZENSET: lambda stack: stack,
    }
    for op, keys_of in keys_at.items():
        dispatch[op[0]] = _keys_checked(dispatch[op[0]], keys_of)


_install_hooks(_SnapshotUnpickler.dispatch)


def _items_of(u: _SnapshotUnpickler, items: Any) -> Sequence[Any]:
    if not isinstance(items, (list, tuple)):
        raise SnapshotError(f"refusing a set built from a {type(items).__name__}")
    u.spend(len(items))  # a memoized list can be passed again and again: each copy counts
    _check_keys(items)
    return items


def _set(u: _SnapshotUnpickler, items: Any = ()) -> set[Any]:
    return set(_items_of(u, items))


def _frozenset(u: _SnapshotUnpickler, items: Any = ()) -> frozenset[Any]:
    return frozenset(_items_of(u, items))


def _ordered_dict(u: _SnapshotUnpickler, *args: Any) -> OrderedDict[Any, Any]:
    if args:  # pickle writes OrderedDict() and then its items with SETITEMS
        raise SnapshotError("refusing an OrderedDict built from arguments")
    u.spend(1)
    return OrderedDict()


def _encode(u: _SnapshotUnpickler, text: Any, encoding: Any = None) -> bytes:
    # bytes pickled with protocols 0-2: _codecs.encode(str, "latin1").
    if type(text) is not str or encoding != "latin1":
        raise SnapshotError("refusing _codecs.encode other than of a str to latin1")
    u.spend(1 + len(text) // 100)  # copies of one memoized str count by their size
    return text.encode("latin-1")


_STAND_INS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): _set,
    ("builtins", "frozenset"): _frozenset,
    ("collections", "OrderedDict"): _ordered_dict,
    ("_codecs", "encode"): _encode,
}

_GZIP_MAGIC = b"\x1f\x8b"


def load_snapshot(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = MAX_SNAPSHOT_BYTES,
    max_objects: int = MAX_PICKLE_OBJECTS,
) -> dict[str, Any]:
    """Read a snapshot written with pickle.dump, optionally gzip-compressed.

    The format is detected from the magic bytes, not the file name. `max_bytes` caps the
    uncompressed size, so that a small gzip bomb cannot exhaust memory; `max_objects` caps
    what the unpickler creates (see MAX_PICKLE_OBJECTS).
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as raw:
            head = raw.read(2)
            raw.seek(0)
            if head == _GZIP_MAGIC:
                with gzip.GzipFile(fileobj=raw) as unzipped:
                    data = unzipped.read(max_bytes + 1)
            else:
                data = raw.read(max_bytes + 1)
    except FileNotFoundError:
        raise SnapshotError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise SnapshotError(f"{name}: is a directory, not a snapshot file") from None
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise SnapshotError(f"{name}: cannot read: {exc}") from None
    if len(data) > max_bytes:
        raise SnapshotError(
            f"{name}: larger than {_fmt_bytes(max_bytes)} uncompressed, the viewer's limit"
        )
    if not data:
        raise SnapshotError(f"{name}: empty file, not a snapshot")
    try:
        obj = _SnapshotUnpickler(io.BytesIO(data), max_objects).load()
    except SnapshotError as exc:
        raise SnapshotError(f"{name}: {exc}") from None
    except Exception as exc:  # any malformed byte string; pickle raises many types
        raise SnapshotError(f"{name}: not a pickle file ({type(exc).__name__})") from None
    if not isinstance(obj, dict) or "segments" not in obj:
        kind = type(obj).__name__
        raise SnapshotError(
            f"{name}: a pickled {kind} without 'segments': not an allocator snapshot"
        )
    return obj


# -- normalised model ------------------------------------------------------------------------
