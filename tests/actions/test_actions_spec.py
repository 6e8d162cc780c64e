"""The admin actions are declared once (exporter/actions/spec.py): the routes, their request
schemas, the CLI's options and the agents' checks all come from that list, and refuse the
same values."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from exporter.actions.base import ActionMethods, Target
from exporter.actions.spec import ACTIONS, BY_NAME, ParamError
from exporter.transport.aggregator import Aggregator
from tests.conftest import REPO_ROOT
from tests.helpers import AUTH, kill_process, make_app, run_cli

FAKE_TORCH = REPO_ROOT / "tests" / "support" / "fake_torch"
# (action, parameters, what the refusal says): one value out of each kind of bound.
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("snapshot", {"record_s": 0}, "record_s: must be above 0"),
    ("snapshot", {"record_s": 301}, "record_s: must be at most 300"),
    ("snapshot", {"stacks": "cpp"}, "stacks: must be one of python, all"),
    ("snapshot", {"max_entries": 0}, "max_entries: must be at least 1"),
    ("empty_cache", {"device": "0"}, "device: expected int"),
    ("empty_cache", {"device": True}, "device: expected int"),
    ("reset_peak", {"device": 1024}, "device: must be at most 1023"),
    ("set_history", {}, "enabled: required"),
    ("set_history", {"enabled": 1}, "enabled: expected bool"),
    ("empty_cache", {"bogus": 1}, "empty_cache takes no parameter bogus"),
]


def test_every_action_method_is_declared_and_every_declaration_has_a_method() -> None:
    methods = {
        name
        for name, member in inspect.getmembers(ActionMethods, inspect.isfunction)
        if not name.startswith("_")
    }
    assert methods == set(BY_NAME)


def test_each_declared_action_has_its_route_and_its_request_schema(tmp_path) -> None:
    app, _ = make_app(tmp_path)
    routes = {
        (method, route.path): route
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods or ()
    }
    schema = TestClient(app).get("/openapi.json").json()
    for action in ACTIONS:
        assert (action.method, action.path) in routes, action.name
        operation = schema["paths"][action.path][action.method.lower()]
        if action.method == "GET":
            names = {p["name"] for p in operation["parameters"]}
        else:
            body = operation["requestBody"]["content"]["application/json"]["schema"]
            names = set(body["properties"])
        assert names == {"pid", "rank", *(p.name for p in action.params)}, action.name


@pytest.mark.parametrize(("name", "params", "why"), REFUSED)
def test_the_api_and_the_declaration_refuse_the_same_values(tmp_path, name, params, why) -> None:
    with pytest.raises(ParamError, match=why):
        BY_NAME[name].check(params)
    app, _ = make_app(tmp_path)  # the demo: its actions change nothing
    action = BY_NAME[name]
    response = TestClient(app).request(action.method, action.path, json=params, headers=AUTH)
    assert response.status_code == 422, response.text


@pytest.mark.slow
def test_the_cli_offers_each_flagged_parameter_with_its_declared_help() -> None:
    commands = {"snapshot": "snapshot", "empty_cache": "empty-cache", "set_history": "history"}
    commands["reset_peak"] = "reset-peak"
    for name, command in commands.items():
        help_text = " ".join(run_cli(command, "--help").stdout.split())
        for param in BY_NAME[name].params:
            if param.flag:
                words = " ".join(param.help.rstrip(".").split())
                assert param.flag in help_text and words[1:] in help_text, (command, param.name)


@pytest.mark.slow
def test_the_cli_names_the_flag_of_a_value_out_of_bounds() -> None:
    proc = run_cli("history", "start", "--url", "http://127.0.0.1:9", "--max-entries", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("--max-entries must be at least 1")


def test_an_agent_refuses_what_the_declaration_refuses() -> None:
    """A launcher of another version may send what this agent's declaration does not take:
    the agent answers `invalid` with the reason, and runs nothing."""
    run_dir = Path(tempfile.mkdtemp(prefix="ga-", dir="/tmp"))  # a socket path under 107 bytes
    aggregator = Aggregator(run_dir)
    script = (
        "import sys, torch\n"
        "from exporter.transport.agent import Agent\n"
        "torch.cuda.set_device(0)\n"
        "Agent(sys.argv[1], interval_s=0.05).start()\n"
        "sys.stdin.read()\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", script, str(run_dir)],
        stdin=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_TORCH), str(REPO_ROOT)])},
    )
    try:
        deadline = time.monotonic() + 30
        while not aggregator.read().allocators and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aggregator.read().allocators, "the agent never reported"
        for name, params, why in REFUSED:
            (result,) = aggregator.command(name, params, Target(), timeout_s=30)
            assert (result.ok, result.outcome) == (False, "invalid"), (name, params)
            assert why in (result.error or ""), (name, result.error)
        (answered,) = aggregator.command("history", {}, Target(), timeout_s=30)
        assert answered.ok, answered.error
    finally:
        kill_process(agent)
        aggregator.close()
        for child in run_dir.iterdir():
            child.unlink()
        run_dir.rmdir()
