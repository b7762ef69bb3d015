"""uvicorn on an event loop beside a grpc.aio server: the scheduler's, or the API process's (``api.api_http``), which
then reaches the scheduler's on a Unix socket (``listen_unix``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from common.security import TLSConfig, is_loopback

log = logging.getLogger("nanoserve.scheduler")


class _Server(uvicorn.Server):
    """The scheduler owns SIGTERM and SIGINT (its drain stops this server); uvicorn must not take them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen(host: str, port: int, name: str = "the HTTP API") -> socket.socket:
    """A listening socket on ``host:port``, bound now so that a port in use fails at start-up as gRPC's does;
    the error names the flag's port by ``name``.

    It names IPPROTO_TCP, so asyncio turns Nagle off on each connection: without it every streamed
    chunk after a connection's first response waited for the client's delayed ACK.
    """
    address = host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen()
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {name} on {host}:{port}: {e.strerror or e}") from e
    return sock


def listen_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` (in the API process's private folder)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()
    return sock


def metrics_tls(tls: TLSConfig | None) -> TLSConfig | None:
    """--metrics-port's TLS: the public API's certificate, but no client certificate required (the scrapers it is
    for, such as the endpoint picker, have none to present)."""
    return TLSConfig(tls.cert_file, tls.key_file) if tls is not None and tls.cert_file else None


def tls_options(tls: TLSConfig | None) -> dict[str, object]:
    """uvicorn's TLS settings for the gRPC server's certificate; its CA, when set, requires client certificates."""
    if tls is None:
        return {}
    options: dict[str, object] = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.require_client_auth:
        options.update(ssl_ca_certs=tls.ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class HttpServer:
    """``app`` on ``host:port``, or with ``unix_path`` on a Unix socket (``host`` and ``port`` unused)."""

    def __init__(self, app: FastAPI, host: str, port: int, tls: TLSConfig | None, name: str = "the HTTP API",
                 unix_path: str = "") -> None:
        self.socket = listen_unix(unix_path) if unix_path else listen(host, port, name)
        self.port: int = 0 if unix_path else self.socket.getsockname()[1]
        # No access log and uvicorn's own lines only from WARNING: the scheduler logs nothing per request at INFO.
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                **tls_options(tls))
        try:
            config.load()  # reads the TLS files now, so a bad one fails at start-up
        except BaseException:
            self.socket.close()
            raise
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None
        if tls is None and not unix_path and not is_loopback(host):
            log.warning("serving plaintext HTTP on non-loopback %s: anyone on the network can reach it; set --tls-*",
                        host)

    def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]), name="http-api")

    def close(self) -> None:
        """Release the port of a server never started."""
        self.socket.close()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, give open responses ``grace_s`` seconds, then close what is left."""
        if self.task is None:
            self.close()
            return
        self.server.config.timeout_graceful_shutdown = grace_s
        self.server.should_exit = True
        await self.task
