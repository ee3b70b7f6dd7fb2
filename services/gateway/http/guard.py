"""The outermost ASGI layer of the HTTP API: what every request passes before the app.

In order: requests are counted (in flight, for the drain; and by route and status, for
metrics); during the drain a new request is refused (503, ``Connection: close``); the
bearer token is checked (401 with ``WWW-Authenticate: Bearer``, before anything else is
looked at); the body's size is bounded (413 from the Content-Length header before the body
is read, or while a chunked body arrives, never after reading it whole).

A WebSocket handshake passes the same checks: it is counted like a request (status 101 once
accepted) and stays in flight while the connection lasts; during the drain it is refused
(503); the token comes in the Authorization header or, since browsers cannot set headers on
a WebSocket, as the subprotocol ``bearer.<token>`` (then echoed as the accepted subprotocol,
which a browser requires); a refused handshake gets the HTTP error response (the ASGI
WebSocket Denial Response), or a close before the accept (1008; 1013 in the drain) where
the server lacks it. A message's size is uvicorn's limit (server.py); a text piece's is the
session's (StreamingSession).

It wraps the FastAPI app as a plain ASGI callable rather than a FastAPI middleware so that
its refusals never reach FastAPI's body parsing, which turns any error raised while reading
into a 400.
"""

from __future__ import annotations

import hmac
import logging

from prometheus_client import Counter
from starlette.routing import Match

from services.common import error_codes as codes
from services.common.metrics import REGISTRY
from services.gateway.http.errors import error_response

log = logging.getLogger(__name__)

HTTP_REQUESTS = Counter("voxring_http_requests", "HTTP API requests by route and status",
                        ["route", "status"], registry=REGISTRY)

# Pages a browser opens without a way to send a bearer header; they hold no data (the
# playground asks for the token and sends it with its API calls).
AUTH_EXEMPT = frozenset({"/", "/docs", "/docs/oauth2-redirect", "/openapi.json"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
BEARER_SUBPROTOCOL = "bearer."  # + the token: a WebSocket's credentials from a browser


class BodyLimit:
    """Reads a body without a Content-Length (chunked) up to ``limit`` bytes; what it read is
    replayed to the app by :meth:`receive`."""

    def __init__(self, receive, limit: int) -> None:
        self._receive = receive
        self._limit = limit
        self._messages: list[dict] = []

    async def read(self) -> bool:
        """True when the whole body fits; False as soon as it does not (the rest unread)."""
        total = 0
        while True:
            message = await self._receive()
            self._messages.append(message)
            if message["type"] != "http.request":
                return True  # the client left; the app sees the disconnect
            total += len(message.get("body", b""))
            if total > self._limit:
                return False
            if not message.get("more_body", False):
                return True

    async def receive(self) -> dict:
        if self._messages:
            return self._messages.pop(0)
        return await self._receive()


class Guard:
    def __init__(self, app, *, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self._token = token.encode("ascii") if token else None
        self.max_body_bytes = max_body_bytes
        self.draining = False
        self.in_flight = 0

    def __repr__(self) -> str:  # never show the token
        return f"{type(self).__name__}(auth={'on' if self._token else 'off'})"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan (off in server.py)
            return
        status = 0
        subprotocol = _bearer_subprotocol(scope)

        async def recording_send(message: dict) -> None:
            nonlocal status
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                status = message["status"]
            elif kind == "websocket.accept":
                status = 101
                if subprotocol is not None and not message.get("subprotocol"):
                    message = {**message, "subprotocol": subprotocol}  # the client's credentials
            elif kind == "websocket.close" and not status:
                status = 403  # closed before the accept: uvicorn answers the handshake 403
            await send(message)

        self.in_flight += 1
        try:
            if scope["type"] == "websocket":
                await self._handle_websocket(scope, receive, recording_send)
            else:
                await self._handle(scope, receive, recording_send)
        finally:
            self.in_flight -= 1
            HTTP_REQUESTS.labels(self.route_of(scope), str(status) if status else "none").inc()

    def route_of(self, scope) -> str:
        """The route's path template (``/v1/audio/voices/{name}``), never the raw path: a
        metric label per distinct URL would grow without bound."""
        route = scope.get("route")
        if route is None:
            for candidate in getattr(self.app, "routes", ()):
                if candidate.matches(scope)[0] is Match.FULL:
                    route = candidate
                    break
        return getattr(route, "path", None) or "unmatched"

    async def _handle(self, scope, receive, send) -> None:
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if scope["method"] in _BODY_METHODS and _header(scope, b"content-length") is None:
            body = BodyLimit(receive, self.max_body_bytes)
            if not await body.read():
                await self._too_large()(scope, receive, send)
                return
            receive = body.receive
        await self.app(scope, receive, send)

    async def _handle_websocket(self, scope, receive, send) -> None:
        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            await refusal(scope, receive, send)  # Starlette sends it as websocket.http.response.*
        else:
            await send({"type": "websocket.close", "code": 1013 if self.draining else 1008})

    def _refusal(self, scope):
        """The error response for a request refused up front, or None."""
        if self.draining:
            return error_response(503, "server is shutting down; retry on another instance", None,
                                  codes.UNAVAILABLE, {"Connection": "close", "Retry-After": "1"})
        if self._token is not None and scope["path"] not in AUTH_EXEMPT:
            problem = self._auth_problem(scope)
            if problem is not None:
                log.info("%s %s -> 401: %s", scope.get("method", "WebSocket"), scope["path"], problem)
                return error_response(401, problem, None, codes.INVALID_API_KEY,
                                      {"WWW-Authenticate": "Bearer"})
        if scope["type"] == "websocket":
            return None
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.isdigit():
                return error_response(400, "Content-Length must be a number of bytes", None,
                                      codes.INVALID_VALUE, {"Connection": "close"})
            if int(length) > self.max_body_bytes:
                return self._too_large()
        return None

    def _too_large(self):
        return error_response(413, f"request body exceeds the limit of {self.max_body_bytes} bytes "
                              "(http.max_body_mb)", None, codes.REQUEST_TOO_LARGE, {"Connection": "close"})

    def _auth_problem(self, scope) -> str | None:
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        offered = _bearer_subprotocols(scope)
        if not values and not offered:
            if scope["type"] == "websocket":
                return ("missing credentials: send the header 'Authorization: Bearer <token>' or the "
                        f"subprotocol '{BEARER_SUBPROTOCOL}<token>'")
            return "missing credentials: send the header 'Authorization: Bearer <token>'"
        if len(values) + len(offered) > 1:
            return "more than one Authorization header" if not offered else "more than one credential"
        if offered:
            presented = offered[0].removeprefix(BEARER_SUBPROTOCOL)
        else:
            scheme, _, presented = values[0].decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not presented.strip():
                return "the Authorization header must be 'Bearer <token>'"
        if not hmac.compare_digest(presented.strip().encode("latin-1", "replace"), self._token):
            return "invalid bearer token"
        return None


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1").strip()
    return None


def _bearer_subprotocols(scope) -> list[str]:
    """The ``bearer.<token>`` subprotocols a WebSocket handshake offers (none for HTTP)."""
    return [p for p in scope.get("subprotocols", ()) if p.startswith(BEARER_SUBPROTOCOL)]


def _bearer_subprotocol(scope) -> str | None:
    """The subprotocol to accept: the one ``bearer.<token>`` offered, if exactly one was."""
    offered = _bearer_subprotocols(scope)
    return offered[0] if len(offered) == 1 else None
