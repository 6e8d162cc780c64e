"""Settings are declared once (exporter.config.Config's fields): variables, flags, the agents'
settings file and docs/settings.md all come from those declarations."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from exporter.config import SETTINGS, Config, load_config
from exporter.run.launcher import write_agent_config
from exporter.transport.agent import CONFIG_NAME, Agent, load_agent_config
from tests.helpers import run_cli


def test_every_field_is_a_declared_setting() -> None:
    assert [f.name for f in fields(Config)] == list(SETTINGS)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["serve", "demo", "run"])
def test_every_setting_but_the_token_is_a_flag_of_each_serving_command(command) -> None:
    help_text = " ".join(run_cli(command, "--help").stdout.split())
    for name, declared in SETTINGS.items():
        flag = "--" + name.replace("_", "-")
        if name == "admin_token":
            assert not declared.flag and f"{flag} " not in help_text  # visible in `ps`
            continue
        assert f"{flag} " in help_text, flag
        assert f"[{declared.env(name)}]" in help_text, name


@pytest.mark.slow
def test_a_flag_wins_over_its_variable_and_is_checked_as_it() -> None:
    env = {"GPUMEM_PORT": "9500", "GPUMEM_SNAPSHOT_MAX_COUNT": "3"}
    config = load_config(env=env, flags={"port": "9600", "snapshot_max_count": None})
    assert (config.port, config.snapshot_max_count) == (9600, 3)
    proc = run_cli("demo", "--snapshot-max-count", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        "--snapshot-max-count: expected a whole number of at least 1, got '0'"
    )


def test_agents_get_the_settings_declared_for_them_and_never_the_token(tmp_path) -> None:
    config = load_config(
        env={},
        admin_token="s3cret",
        interval_s=0.25,
        labels="model=llama",
        kubelet_resources="example.com/gpu",
        snapshot_dir=str(tmp_path / "snaps"),
    )
    write_agent_config(config, str(tmp_path))
    written = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert set(written) == {name for name, declared in SETTINGS.items() if declared.agents}
    assert "s3cret" not in (tmp_path / CONFIG_NAME).read_text()
    agent_config = load_agent_config(str(tmp_path))
    for name in written:
        assert getattr(agent_config, name) == getattr(config, name), name
    # The sampling pace reaches an agent once, through this file (not also its environment).
    assert Agent(str(tmp_path)).interval_s == 0.25
