"""/metrics for every sample of the recorded traces (the demo's and the H200 OOM storm), in
every mode, in both formats, and through the demo's own replay path, equal byte for byte to
the digests in tests/data/exposition_digests.json (recorded on the tree before the
redesign of issue 39 by scripts/exposition_digests.py, and equal on it after)."""

from __future__ import annotations

import json
import runpy

import pytest

from tests.conftest import DATA_DIR, REPO_ROOT

pytestmark = pytest.mark.slow


def test_every_exposition_of_the_recorded_traces_is_unchanged() -> None:
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "exposition_digests.py"))
    expected = json.loads((DATA_DIR / "exposition_digests.json").read_text())
    assert set(expected) == {
        f"{path} {mode}" for path in script["TRACES"] for mode in (*script["MODES"], "replayed")
    }
    for key, digests in expected.items():
        path, mode = key.split(" ")
        found = script["replayed"](path) if mode == "replayed" else script["digests"](path, mode)
        changed = [i for i, (a, b) in enumerate(zip(found, digests, strict=True)) if a != b]
        assert not changed, f"{key}: samples {changed[:10]} render otherwise"
