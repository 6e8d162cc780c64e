"""A host inference app served by uvicorn with uvicorn's default logging (access log on), which
starts the embedded exporter from its startup hook, as servers do:
`python tests/support/uvicorn_host_app.py HOST_PORT EXPORTER_PORT`. It prints "ready" once
both serve. tests/http/test_server.py checks what lands in the host's log."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

import uvicorn
from fastapi import FastAPI

import exporter

EXPORTER_PORT = int(sys.argv[2])


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    handle = exporter.start(port=EXPORTER_PORT, interval_s=0.2)
    print("ready" if handle.error is None else f"error {handle.error}", flush=True)
    yield
    handle.stop()


app = FastAPI(lifespan=lifespan)


@app.get("/v1/models")
def models() -> dict[str, list[str]]:
    return {"data": ["host-model"]}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]))  # uvicorn's default log config
