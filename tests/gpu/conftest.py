"""The GPU tests compare every family with an independent reading, the breakdowns included: the
exporters they start (in this process or as children) serve the full detail level."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def full_detail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMEM_DETAIL", "full")
