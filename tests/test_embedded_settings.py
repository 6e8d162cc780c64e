"""A second exporter.start() or attach() returns the running exporter, and says which of the
settings it asked for were not applied (never a token's value)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

import exporter
from exporter.config import ConfigError

QUIET: dict[str, Any] = {"serve_http": False, "torch": False, "nvml": False}


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture, monkeypatch) -> Iterator[pytest.LogCaptureFixture]:
    for name in ("GPUMEM_ADMIN_TOKEN", "GPUMEM_INTERVAL_S", "GPUMEM_PORT", "GPUMEM_LABELS"):
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.DEBUG, logger="exporter")
    yield caplog
    exporter.stop()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_same_settings_again_are_quiet(log):
    handle = exporter.start(interval_s=0.5, labels={"model": "a"}, **QUIET)
    assert exporter.start(interval_s=0.5, labels={"model": "a"}, **QUIET) is handle
    assert exporter.start(serve_http=False) is handle  # asks for nothing in particular
    assert warnings(log) == []
    assert "already started" in log.text  # at debug level


def test_other_settings_are_named_and_a_token_never_shown(log):
    handle = exporter.start(interval_s=0.5, admin_token="first-secret", **QUIET)
    again = exporter.start(
        interval_s=2, port=9500, admin_token="second-secret", labels={"model": "b"}, **QUIET
    )
    assert again is handle and handle.config.interval_s == 0.5
    [message] = warnings(log)
    assert "exporter.start() called again" in message
    assert "interval_s is 0.5, not 2.0" in message
    assert "port is 9445, not 9500" in message
    assert "labels is {}, not {'model': 'b'}" in message
    assert "admin_token differs" in message
    assert "secret" not in log.text


def test_options_of_the_call_are_compared_too(log, tmp_path):
    handle = exporter.start(**QUIET)
    assert exporter.start(torch=False, nvml=False, record_to=tmp_path / "t.gz") is handle
    [message] = warnings(log)
    assert "serve_http is False, not True" in message
    assert f"record_to is None, not '{tmp_path / 't.gz'}'" in message
    assert not (tmp_path / "t.gz").exists()


def test_attach_to_another_app_or_after_start_says_so(log):
    registry = CollectorRegistry()
    app = FastAPI()
    handle = exporter.attach(app, registry=registry, interval_s=60, torch=False, nvml=False)
    assert exporter.attach(app, registry=registry) is handle
    assert warnings(log) == []
    other = FastAPI()
    assert exporter.attach(other, registry=registry) is handle
    assert warnings(log) == [
        "gpumem-exporter: exporter.attach() called again; it returns the "
        "running exporter, which keeps its own settings (stop() it first "
        "to change them): app differs"
    ]
    assert "/healthz" not in {getattr(r, "path", None) for r in other.routes}
    log.clear()
    assert exporter.start(serve_http=False) is handle
    assert "the running exporter was started by exporter.attach()" in warnings(log)[0]


def test_invalid_settings_of_a_second_call_still_raise(log):
    exporter.start(**QUIET)
    with pytest.raises(ConfigError, match="port"):
        exporter.start(port="nine", **QUIET)  # type: ignore[arg-type]  # a caller's mistake


def test_a_handle_prints_as_one_short_line(tmp_path):
    """print(handle) in a notebook: what it is and where, not the whole runtime (issue 38)."""
    import exporter

    handle = exporter.start(port=0, snapshot_dir=str(tmp_path / "snaps"), torch=False, nvml=False)
    try:
        text = repr(handle)
        assert text.startswith("<gpumem-exporter start running url=http://127.0.0.1:")
        assert "\n" not in text and len(text) < 120
    finally:
        exporter.stop()
    assert "stopped" in repr(handle)
