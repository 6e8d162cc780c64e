"""Basic auth against the web config's bcrypt hashes, as exporter-toolkit checks it.

A bcrypt check at cost 10 takes ~70 ms: done for every scrape it would be most of the
exporter's CPU. So, as exporter-toolkit does, the outcome of a (user, hash, password) is
remembered under a SHA-256 of the three rather than the password itself: the right ones
(100, the oldest used first out) apart from the wrong ones (100, random eviction), so that a
flood of wrong passwords never pushes out the one Prometheus sends, which would then queue
for a check behind the flood's (issue 64: 17 of 105 scrapes lost to 503 with one shared
cache). A user not in the file is checked against a hash of the same cost as the file's (the
highest where they differ), so that the time of an answer does not tell which users exist
(exporter-toolkit's fixed cost-10 hash told a cost-12 user apart: 249 ms against 64 ms,
round 4); one check runs at a time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import random
import threading
from collections import OrderedDict
from collections.abc import Mapping

CACHE_SIZE = 100
# bcrypt of "fakepassword" at cost 10: what an unknown user is checked against where the
# file's hashes are of cost 10 (the usual one); other costs get a hash of their own, made once.
_UNKNOWN_USER_HASH = "$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"


def parse_basic(header: str) -> tuple[str, str] | None:
    """(user, password) of an `Authorization: Basic ...` value, or None."""
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, found, password = decoded.partition(":")
    return (user, password) if found else None


class BasicAuth:
    def __init__(self) -> None:
        self._right: OrderedDict[bytes, bool] = OrderedDict()  # by last use, oldest first
        self._wrong: dict[bytes, bool] = {}
        self._cache_lock = threading.Lock()  # held for a lookup, never across a bcrypt
        self._bcrypt_lock = threading.Lock()  # one bcrypt at a time (it is CPU-bound)
        self._unknown_user = {10: _UNKNOWN_USER_HASH}  # cost -> a hash of no password in use

    def check(
        self, users: Mapping[str, str], header: str, *, may_block: bool = True
    ) -> bool | None:
        """Whether `header` authenticates a user of `users` (name -> bcrypt hash). None where
        the answer needs a bcrypt check and `may_block` is False: the event loop must not
        spend 70 ms on a password it has not seen (the caller asks again from a thread)."""
        credentials = parse_basic(header)
        if credentials is None:
            return False
        user, password = credentials
        hashed = users.get(user)
        known = hashed is not None
        cost = 0 if known else max((_cost(h) for h in users.values()), default=10)
        hashed = hashed or self._unknown_user.get(cost, "")
        key = hashlib.sha256("\0".join((user, hashed, password)).encode()).digest()
        with self._cache_lock:
            ok = self._cached(key) if hashed else None
        if ok is None:
            if not may_block:
                return None
            with self._bcrypt_lock:
                if not hashed:  # the first unknown user at this cost: its hash, made once
                    hashed = self._unknown_user[cost] = _hash_of_nothing(cost)
                    key = hashlib.sha256("\0".join((user, hashed, password)).encode()).digest()
                ok = _bcrypt_ok(password, hashed)
            with self._cache_lock:
                self._remember(key, ok)
        return ok and known

    def _cached(self, key: bytes) -> bool | None:
        if key in self._right:
            self._right.move_to_end(key)  # used now: the last to go
            return True
        return self._wrong.get(key)

    def _remember(self, key: bytes, ok: bool) -> None:
        if ok:
            self._right[key] = True
            self._right.move_to_end(key)
            while len(self._right) > CACHE_SIZE:
                self._right.popitem(last=False)
            return
        if len(self._wrong) >= CACHE_SIZE:
            # A tenth at once, chosen at random, so that eviction is not done every time.
            for victim in random.sample(list(self._wrong), max(len(self._wrong) // 10, 1)):
                del self._wrong[victim]
        self._wrong[key] = False


def _cost(hashed: str) -> int:
    """The cost of a bcrypt hash ($2y$12$...), 10 where it cannot be read."""
    part = hashed.split("$")[2] if hashed.count("$") >= 3 else ""
    return int(part) if part.isdigit() and 4 <= int(part) <= 31 else 10


def _hash_of_nothing(cost: int) -> str:
    import secrets

    import bcrypt

    password = secrets.token_bytes(32)  # nobody's: only its cost matters
    return bcrypt.hashpw(password, bcrypt.gensalt(cost)).decode()


def _bcrypt_ok(password: str, hashed: str) -> bool:
    import bcrypt  # only where basic auth is configured

    try:
        return bool(bcrypt.checkpw(password.encode(), hashed.encode()))
    except ValueError:  # a password over bcrypt's 72 bytes (bcrypt 5 refuses it)
        return False
