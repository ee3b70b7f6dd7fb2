"""The HTTP API as a component of the gateway's ServiceHost: uvicorn inside the gRPC server's
event loop, on ``http.listen``, with the gRPC server's TLS files and bearer token.

One loop for both APIs keeps one in-flight table, one admission count and one set of
channels to the engine pairs. The host owns the process's signals: uvicorn's own handlers
are never installed (:class:`_HostedServer`), and the host's drain drives this server:

- ``begin_drain()`` (SIGTERM): new requests are refused with 503 (guard.Guard);
- ``idle()``: True once no request is in flight, so streams finish within drain_timeout;
- ``stop(timeout)``: uvicorn's shutdown closes the listener and the idle connections; a
  request still running after ``timeout`` is cancelled, which cancels it on both stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from services.common.loop_task import LoopTask
from services.common.sections import is_loopback, parse_listen
from services.gateway.config import GatewayConfig
from services.gateway.http.app import ApiParts, create_app
from services.gateway.http.guard import Guard

log = logging.getLogger(__name__)

_CLOSE_MARGIN_S = 2.0  # beyond uvicorn's graceful timeout, for its last connections to close


class _HostedServer(uvicorn.Server):
    """uvicorn without its signal handlers: it replaces the process's handlers while it serves
    (and re-raises a captured signal when it stops), which would take SIGTERM from the host."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(listen: str) -> socket.socket:
    """A listening TCP socket on ``listen`` (HOST:PORT, [IPV6]:PORT; port 0: a free one)."""
    host, port = parse_listen(listen)
    host = host.strip("[]")
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {listen} (http.listen): {exc.strerror or exc}") from None
    return sock


class HttpServer(LoopTask):
    name = "http server"

    def __init__(self, config: GatewayConfig, parts: ApiParts, token: str | None = None) -> None:
        super().__init__()
        if config.http.listen is None:
            raise ValueError("http.listen is null: the HTTP server is off")
        self.config = config
        self.guard = Guard(create_app(parts), token=token,
                           max_body_bytes=int(config.http.max_body_mb * 1024 * 1024))
        self.tls = config.server.tls_cert is not None
        self.address: str | None = None
        self._sock: socket.socket | None = None
        self._server: _HostedServer | None = None

    def start(self) -> None:
        listen = self.config.http.listen
        if not is_loopback(listen):
            log.warning("HTTP API on non-loopback address %s%s", listen,
                        "" if self.tls else " without TLS (server.tls_cert/tls_key)")
        self._sock = bind(listen)
        host = listen.rpartition(":")[0]
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        server = self.config.server
        # WebSockets (/v1/audio/speech/stream) through the websockets package's sans-I/O
        # protocol, which sends the guard's HTTP refusals of a handshake (401, 503); a message
        # is bounded as a body is (http.max_body_mb); no per-message deflate: audio gains
        # little from it, and compressing would cost the event loop's time
        uv = uvicorn.Config(self.guard, lifespan="off", log_config=None, access_log=False,
                            server_header=False, ws="websockets-sansio",
                            ws_max_size=self.guard.max_body_bytes, ws_per_message_deflate=False,
                            proxy_headers=False,
                            ssl_certfile=server.tls_cert, ssl_keyfile=server.tls_key,
                            timeout_graceful_shutdown=max(server.grace, 0.1))
        uv.load()  # the TLS context now, not inside the task: a failure stops the start-up
        self._server = _HostedServer(uv)
        super().start()
        log.info("HTTP API on %s://%s (docs at /docs)", "https" if self.tls else "http", self.address)

    async def run(self) -> None:
        await self._server.serve(sockets=[self._sock])

    def ready_info(self) -> dict:
        """Added to the stage's ready file: where the HTTP API listens."""
        return {"http": self.address}

    def begin_drain(self) -> None:
        self.guard.draining = True

    def idle(self) -> bool:
        return self.guard.in_flight == 0

    async def aclose(self) -> None:
        self.stopping = True
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.wait({self._task}, timeout=self.config.server.grace + _CLOSE_MARGIN_S)
        if not self._task.done():
            log.warning("HTTP server did not stop in time; closing its connections")
            self._server.force_exit = True
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=_CLOSE_MARGIN_S)

    def stop(self, timeout: float) -> None:
        super().stop(timeout + 2 * _CLOSE_MARGIN_S)  # aclose() bounds its own waits
