"""What the HTTP layer takes from the internals of uvicorn, asyncio and ssl is named in one
place (exporter.internals.RELIED_ON) and still there in the installed versions: an
upgrade that moves one fails here, not in a production server. And no other module of the
package reaches into them."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from exporter import internals
from tests.conftest import REPO_ROOT

THIRD_PARTY = ("uvicorn", "asyncio", "ssl", "httptools", "h11", "starlette", "fastapi")


async def _app(scope: Any, receive: Any, send: Any) -> None:
    pass


@pytest.fixture
def instances() -> Iterator[dict[str, Any]]:
    """One object of each kind RELIED_ON names, built as the exporter builds them: instance
    attributes exist only on an instance."""
    loop = asyncio.new_event_loop()
    config = uvicorn.Config(_app)
    config.load()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    protocol = HttpToolsProtocol(config, ServerState(), {}, loop)
    tls = internals.AlertingTlsProtocol(
        loop,
        asyncio.Protocol(),
        context,
        None,  # type: ignore[arg-type]  # no waiter: asyncio's own servers pass None
        server_side=True,
    )
    yield {
        "asyncio.sslproto.SSLProtocol": tls,
        "uvicorn.Server": uvicorn.Server(config),
        "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol": protocol,
    }
    _close_app_transport(tls)
    loop.close()


def _close_app_transport(protocol: asyncio.sslproto.SSLProtocol) -> None:
    """The application's side of a TLS protocol never connected: closed, or the garbage
    collector warns of it (a ResourceWarning, an error under -W error)."""
    with contextlib.suppress(Exception):  # its shutdown has no connection to go to
        protocol._app_transport.close()


def _owner(name: str, instances: dict[str, Any]) -> Any:
    """The instance built for `name`, else the object its dotted path names (a module, or
    an attribute of one: ssl._ssl)."""
    if name in instances:
        return instances[name]
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise AssertionError(f"nothing importable in {name}")


@pytest.mark.parametrize(("owner", "attribute"), internals.RELIED_ON)
def test_each_internal_relied_on_is_there(owner, attribute, instances):
    assert hasattr(_owner(owner, instances), attribute), (
        f"{owner}.{attribute} is gone in the installed version: exporter.internals "
        "relies on it (see its docstring); pyproject.toml bounds the versions checked"
    )


def test_a_failed_handshake_sends_what_handshake_done_answers():
    """The one behaviour built on the private names: at a failed handshake the alert (or the
    subclass's own answer) is written before asyncio closes."""
    written: list[bytes] = []

    class Transport:
        def write(self, data: bytes) -> None:
            written.append(data)

        def abort(self) -> None:
            written.append(b"<aborted>")

        def is_closing(self) -> bool:
            return False

    class Answering(internals.AlertingTlsProtocol):
        def handshake_done(self, exc: BaseException | None) -> bytes | None:
            return b"HTTP/1.0 400 Bad Request\r\n\r\n" if exc is not None else None

    loop = asyncio.new_event_loop()
    try:
        protocol = Answering(
            loop, asyncio.Protocol(), ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER),
            None,  # type: ignore[arg-type]  # no waiter, as asyncio's own servers
            server_side=True,
        )  # fmt: skip
        protocol._transport = Transport()  # type: ignore[assignment]  # as connection_made
        with contextlib.suppress(Exception):  # asyncio's own handling, after ours
            protocol._on_handshake_complete(ssl.SSLError(1, "handshake failure"))
        assert written[0] == b"HTTP/1.0 400 Bad Request\r\n\r\n"
        protocol.abort()
        assert written[-1] == b"<aborted>"
    finally:
        _close_app_transport(protocol)
        loop.close()


def _private_reaches(path: Path) -> Iterator[str]:
    """`module._name` on a module of THIRD_PARTY (or a name imported from one), and
    `super()._name`, in one source file."""
    tree = ast.parse(path.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] in THIRD_PARTY
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in THIRD_PARTY:
            imported |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__"):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in imported:
            yield f"{path.name}:{node.lineno} {value.id}.{node.attr}"
        elif (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "super"
        ):
            yield f"{path.name}:{node.lineno} super().{node.attr}"


def _outside_internals(find: Callable[[Path], Iterator[str]]) -> list[str]:
    """What `find` finds in every module of the package but exporter/internals.py."""
    internals_py = REPO_ROOT / "exporter" / "internals.py"
    paths = sorted((REPO_ROOT / "exporter").rglob("*.py"))
    return [found for path in paths if path != internals_py for found in find(path)]


def test_no_other_module_reaches_into_their_internals():
    assert _outside_internals(_private_reaches) == []


def _submodule_imports(path: Path) -> Iterator[str]:
    """Imports of a submodule of uvicorn or asyncio (uvicorn.server, asyncio.sslproto, ...):
    their packages' own names are public, what lies under them is not."""
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("uvicorn", "asyncio") and "." in name:
                yield f"{path.name}:{node.lineno} {name}"


def test_no_other_module_imports_from_inside_uvicorn_or_asyncio():
    """The guard wraps uvicorn's protocol without importing it (exporter.internals makes it):
    only internals.py takes anything from inside uvicorn or asyncio."""
    assert _outside_internals(_submodule_imports) == []
