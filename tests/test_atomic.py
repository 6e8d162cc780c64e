"""Atomic writes keep what the exporter writes for itself private, and give the files a user
names (`view -o`, `record -o`) the user's own mode."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest

from exporter import atomic
from exporter.trace import TraceWriter
from tests.helpers import captured_sample


@pytest.fixture
def umask() -> Iterator[None]:
    """A permissive umask for the test, as a user may have."""
    old = os.umask(0o002)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_exporters_own_files_stay_private_whatever_the_umask(tmp_path, umask):
    assert mode(atomic.write_bytes(tmp_path / "snapshot.pickle", b"x")) == 0o600
    writer = TraceWriter(tmp_path / "t.gz")
    writer(captured_sample("native"))
    assert mode(writer.close()) == 0o600


def test_a_users_file_gets_the_umask_or_keeps_its_own_mode(tmp_path, umask):
    assert atomic.current_umask() == 0o002
    path = atomic.write_bytes(tmp_path / "page.html", b"x", private=False)
    assert mode(path) == 0o664
    path.chmod(0o640)
    assert mode(atomic.write_bytes(path, b"y", private=False)) == 0o640
    writer = TraceWriter(tmp_path / "t.gz", private=False, live=True)
    writer(captured_sample("native"))  # a live trace is published at its first sample
    assert mode(tmp_path / "t.gz") == 0o664
    writer.close()


def test_the_umask_is_read_without_changing_it(umask):
    before = os.umask(0o002)
    os.umask(before)
    assert atomic.current_umask() == before == 0o002
