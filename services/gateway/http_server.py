"""uvicorn serving the HTTP API as a task on the gateway's own asyncio loop (beside grpc.aio),
on a socket bound up front so that port 0 works and the real port is known before serving."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Generator

import structlog
import uvicorn
from fastapi import FastAPI

log = structlog.get_logger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """Leaves signals to the gateway (serve_until_stopped): uvicorn must not capture SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """`reuse_port`: several gateway processes listen on this one port and the kernel spreads new
    connections over them. A process holding the port without SO_REUSEPORT still makes the bind
    fail, so "port in use" keeps working against anything that is not a sibling gateway."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot bind the HTTP API to {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpServer:
    """Binds at construction; `start()` serves in a background task; `stop()` closes it."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        ssl_cert_file: str = "",
        ssl_key_file: str = "",
        ssl_ca_file: str = "",
        client_auth: bool = False,
        reuse_port: bool = False,
    ) -> None:
        bind_host = host.strip("[]") or "0.0.0.0"
        self._sock = _bind(bind_host, port, reuse_port)
        self.port: int = self._sock.getsockname()[1]
        shown = "127.0.0.1" if bind_host in ("0.0.0.0", "::") else bind_host
        self.base_url = f"{'https' if ssl_cert_file else 'http'}://{shown}:{self.port}"
        config = uvicorn.Config(
            app,
            log_config=None,  # structlog owns logging
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            ssl_certfile=ssl_cert_file or None,
            ssl_keyfile=ssl_key_file or None,
            ssl_ca_certs=ssl_ca_file or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if client_auth else ssl.CERT_NONE,
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises why it could not start
        log.info("http_listening", url=f"{self.base_url}/v1")

    async def stop(self) -> None:
        """Stop accepting; connections still open get a few seconds (streams have drained by now)."""
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._task = None
        self._sock.close()
