"""Configuration: defaults, GPUMEM_* environment, explicit values, and clear errors."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from exporter.config import Config, ConfigError, load_config


def test_defaults():
    config = load_config(env={})
    assert (config.host, config.port, config.interval_s) == ("127.0.0.1", 9445, 1.0)
    assert config.stale_threshold_s == 5.0
    assert config.resolved_admin_token() is None


def test_environment_then_explicit_values_win():
    env = {
        "GPUMEM_PORT": "9500",
        "GPUMEM_INTERVAL_S": "0.5",
        "GPUMEM_LABELS": "model=llama",
        "GPUMEM_NVML": "off",
        "GPUMEM_HOST": "0.0.0.0",
    }
    config = load_config(env=env)
    assert (config.port, config.interval_s, config.labels, config.nvml, config.host) == (
        9500,
        0.5,
        {"model": "llama"},
        False,
        "0.0.0.0",
    )
    assert load_config(env=env, port=9600, labels={"tier": "prod"}).port == 9600
    assert load_config(env=env, port=None).port == 9500  # None means "not given"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPUMEM_PORT": "http"}, "GPUMEM_PORT: expected an integer 0-65535, got 'http'"),
        ({"GPUMEM_PORT": "70000"}, "GPUMEM_PORT: expected an integer"),
        ({"GPUMEM_INTERVAL_S": "0"}, "GPUMEM_INTERVAL_S: expected seconds between 0.01"),
        ({"GPUMEM_INTERVAL_S": "nan"}, "GPUMEM_INTERVAL_S"),
        ({"GPUMEM_HOST": "example.com"}, "GPUMEM_HOST: expected an IP address"),
        ({"GPUMEM_LABELS": "model"}, "GPUMEM_LABELS: expected name=value"),
        ({"GPUMEM_LABELS": "device=3"}, "unreserved label name"),
        ({"GPUMEM_LABELS": "1x=3"}, "GPUMEM_LABELS"),
        ({"GPUMEM_NVML": "maybe"}, "GPUMEM_NVML: expected true or false"),
    ],
)
def test_bad_values_name_the_setting(env, message):
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_keyword_is_an_error():
    with pytest.raises(ConfigError, match="unknown setting 'prot'"):
        load_config(env={}, prot=1)


def test_token_file_is_read_and_stripped_and_never_shown(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config = load_config(env={"GPUMEM_ADMIN_TOKEN_FILE": str(token_file)})
    assert config.resolved_admin_token() == "s3cret"
    assert "s3cret" not in repr(load_config(env={"GPUMEM_ADMIN_TOKEN": "s3cret"}))
    missing = Config(admin_token_file=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="cannot read admin token file"):
        missing.resolved_admin_token()


def test_a_token_file_that_cannot_be_read_at_start_is_an_error(tmp_path):
    """A wrong path or a Secret that is not mounted must not start with the admin API off."""
    with pytest.raises(ConfigError) as error:
        load_config(env={"GPUMEM_ADMIN_TOKEN_FILE": str(tmp_path / "nope")})
    message = str(error.value)
    assert message.startswith("GPUMEM_ADMIN_TOKEN_FILE: cannot read admin token file ")
    assert "No such file" in message and "\n" not in message
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ConfigError, match="cannot read admin token file"):
        load_config(env={}, admin_token_file=str(folder))
    empty = tmp_path / "empty"
    empty.write_text("")  # a rotation may leave it empty: admin off until it is written
    assert load_config(env={}, admin_token_file=str(empty)).resolved_admin_token() is None


def test_token_whitespace_is_stripped_and_never_half_kept(tmp_path):
    """A token with a trailing newline (`echo x > file`, a Secret from a file) or spaces
    around it works; one with whitespace inside can never match a bearer header."""
    assert load_config(env={"GPUMEM_ADMIN_TOKEN": "  Zq9kret\n"}).admin_token == "Zq9kret"
    token_file = tmp_path / "token"
    token_file.write_text(" Zq9kret \n")
    assert load_config(env={}, admin_token_file=str(token_file)).resolved_admin_token() == "Zq9kret"
    for bad in ("Zq9 kret", "Zq9kret\nsecond", "Zq9\tkret"):
        with pytest.raises(ConfigError, match="whitespace or control characters") as error:
            load_config(env={"GPUMEM_ADMIN_TOKEN": bad})
        assert "Zq9" not in str(error.value)  # the token is never shown
        token_file.write_text(bad)
        with pytest.raises(ConfigError, match="whitespace or control characters") as error:
            load_config(env={}, admin_token_file=str(token_file))
        assert "Zq9" not in str(error.value)


def test_the_process_list_cadence_reaches_the_nvml_source():
    from exporter.runtime import sources_for
    from exporter.sources.nvml import NvmlSource

    config = load_config(env={"GPUMEM_PROCESS_INTERVAL_S": "3"})
    (nvml,) = [s for s in sources_for("embedded", config) if isinstance(s, NvmlSource)]
    assert nvml._process_interval_s == 3.0
    with pytest.raises(ConfigError, match="GPUMEM_PROCESS_INTERVAL_S"):
        load_config(env={"GPUMEM_PROCESS_INTERVAL_S": "-1"})


def test_the_layout_settings_reach_the_allocator_source_and_are_checked():
    from exporter.runtime import sources_for
    from exporter.sources.torch_allocator import TorchAllocatorSource

    config = load_config(env={"GPUMEM_LAYOUT_INTERVAL_S": "0", "GPUMEM_LAYOUT_MAX_BLOCKS": "50"})
    (torch,) = [s for s in sources_for("embedded", config) if isinstance(s, TorchAllocatorSource)]
    assert (torch._layout_interval_s, torch._layout_max_blocks) == (0.0, 50)
    for name, value in (("GPUMEM_LAYOUT_INTERVAL_S", "-1"), ("GPUMEM_LAYOUT_MAX_BLOCKS", "x")):
        with pytest.raises(ConfigError, match=name):
            load_config(env={name: value})


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "huge", "directory"])
def test_a_token_file_that_is_not_a_small_regular_file_fails_at_once(tmp_path, kind):
    """A FIFO would hang start-up silently and /dev/zero never ends (issue 38)."""
    path = tmp_path / "token"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path = Path("/dev/zero")
    elif kind == "huge":
        path.write_bytes(b"x" * (1 << 20))
    else:
        path.mkdir()
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, admin_token_file=str(path))
    assert time.monotonic() - started < 2
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    assert any(w in message for w in ("not a regular file", "larger than", "Is a directory"))
