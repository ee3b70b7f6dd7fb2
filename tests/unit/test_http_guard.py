"""The HTTP API's outer layer on plain ASGI messages: the token before anything else, the
body limit before the body is read whole, the drain's refusals, the in-flight count and
the per-route metric; the same for WebSocket handshakes (the token also as a subprotocol)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request, WebSocket

from services.common.metrics import REGISTRY
from services.gateway.http.guard import Guard

TOKEN = "s3cret-token"
LIMIT = 1000


def _app(seen: list):
    app = FastAPI()

    @app.post("/v1/echo/{name}")
    async def echo(name: str, request: Request):
        body = await request.body()
        seen.append(body)
        return {"bytes": len(body)}

    @app.get("/")
    async def page():
        return {"page": True}

    @app.websocket("/v1/socket/{name}")
    async def socket(websocket: WebSocket, name: str):
        seen.append(name)
        await websocket.accept()
        await websocket.send_text(name)
        await websocket.close()

    return app


class Wire:
    """One request's ASGI channel: body chunks out (counted as they are read), messages in."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)
        self.read = 0
        self.sent: list[dict] = []

    async def receive(self):
        if not self.chunks:
            await asyncio.Event().wait()  # nothing more comes: the client waits for the answer
        self.read += 1
        body = self.chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(self.chunks)}

    async def send(self, message):
        self.sent.append(message)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(next(m for m in self.sent if m["type"] == "http.response.start")["headers"])

    @property
    def json(self):
        bodies = [m.get("body", b"") for m in self.sent if m["type"] == "http.response.body"]
        return json.loads(b"".join(bodies))


def _call(guard: Guard, path: str, chunks=(b"",), method="POST", headers=()):
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    wire = Wire(list(chunks))
    asyncio.run(asyncio.wait_for(guard(scope, wire.receive, wire.send), 5))
    return wire


def _guard(token=TOKEN):
    seen: list = []
    return Guard(_app(seen), token=token, max_body_bytes=LIMIT), seen


AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.mark.parametrize("headers", [(), (("authorization", "Bearer nope"),), (("authorization", TOKEN),),
                                     (("authorization", "Basic " + TOKEN),), AUTH * 2])
def test_a_missing_or_wrong_token_is_401_before_the_body_is_read(headers):
    guard, seen = _guard()
    wire = _call(guard, "/v1/echo/a", [b"x" * 10], headers=(*headers, ("content-length", "10")))
    assert wire.status == 401 and wire.headers[b"www-authenticate"] == b"Bearer"
    assert wire.json["error"]["code"] == "invalid_api_key" and wire.read == 0 and not seen
    assert TOKEN not in json.dumps(wire.json)


def test_the_token_lets_requests_through_and_pages_need_none():
    guard, seen = _guard()
    wire = _call(guard, "/v1/echo/a", [b"abc"], headers=(*AUTH, ("content-length", "3")))
    assert wire.status == 200 and seen == [b"abc"]
    assert _call(guard, "/", method="GET").status == 200
    assert _call(guard, "/openapi.json", method="GET").status == 200


def test_no_token_configured_means_no_check():
    guard, _ = _guard(token=None)
    assert _call(guard, "/v1/echo/a", [b"{}"], headers=(("content-length", "2"),)).status == 200


def test_a_content_length_over_the_limit_is_413_without_reading():
    guard, seen = _guard()
    wire = _call(guard, "/v1/echo/a", [b"x" * 100], headers=(*AUTH, ("content-length", "100000000")))
    assert wire.status == 413 and wire.read == 0 and not seen
    assert wire.headers[b"connection"] == b"close"
    bad = _call(guard, "/v1/echo/a", [b""], headers=(*AUTH, ("content-length", "ten")))
    assert bad.status == 400


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit():
    guard, seen = _guard()
    chunks = [b"x" * 300] * 10  # 3000 bytes against a limit of 1000
    wire = _call(guard, "/v1/echo/a", chunks, headers=AUTH)
    assert wire.status == 413 and wire.read == 4 and not seen  # 1200 bytes read, the rest never


def test_a_chunked_body_within_the_limit_reaches_the_app_whole():
    guard, seen = _guard()
    wire = _call(guard, "/v1/echo/a", [b"ab", b"cd", b"ef"], headers=AUTH)
    assert wire.status == 200 and seen == [b"abcdef"]


def test_draining_refuses_new_requests_with_503():
    guard, seen = _guard()
    guard.draining = True
    wire = _call(guard, "/v1/echo/a", [b""], headers=AUTH)
    assert wire.status == 503 and wire.headers[b"connection"] == b"close" and not seen


def test_in_flight_counts_requests_while_they_run():
    seen_in_flight = []
    guard = Guard(None, token=None, max_body_bytes=LIMIT)

    async def app(scope, receive, send):
        seen_in_flight.append(guard.in_flight)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard.app = app
    _call(guard, "/x", method="GET")
    assert seen_in_flight == [1] and guard.in_flight == 0


def _count(route: str, status: str) -> float:
    return REGISTRY.get_sample_value("voxring_http_requests_total", {"route": route, "status": status}) or 0.0


def test_metrics_count_by_route_template_and_status():
    guard, _ = _guard()
    before = _count("/v1/echo/{name}", "401")
    _call(guard, "/v1/echo/one", [b""])
    _call(guard, "/v1/echo/two", [b""])
    assert _count("/v1/echo/{name}", "401") == before + 2
    before = _count("unmatched", "404")
    _call(guard, "/nothing/here", method="GET", headers=AUTH)
    assert _count("unmatched", "404") == before + 1


class SocketWire:
    """One WebSocket's ASGI channel: the handshake's connect, then a client that stays."""

    def __init__(self) -> None:
        self.connected = False
        self.sent: list[dict] = []

    async def receive(self):
        if not self.connected:
            self.connected = True
            return {"type": "websocket.connect"}
        await asyncio.Event().wait()

    async def send(self, message):
        self.sent.append(message)

    @property
    def types(self) -> list[str]:
        return [m["type"] for m in self.sent]


def _socket(guard: Guard, headers=(), subprotocols=(), denial=True) -> SocketWire:
    """A handshake on /v1/socket/x; ``denial``: the server can answer it with HTTP (uvicorn can)."""
    path = "/v1/socket/x"
    scope = {"type": "websocket", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "scheme": "ws", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "subprotocols": list(subprotocols),
             "extensions": {"websocket.http.response": {}} if denial else {}}
    wire = SocketWire()
    asyncio.run(asyncio.wait_for(guard(scope, wire.receive, wire.send), 5))
    return wire


@pytest.mark.parametrize(("headers", "subprotocols"), [
    ((), ()), ((), ("bearer.nope",)), ((("authorization", "Bearer nope"),), ()), ((), ("chat",)),
    (AUTH, (f"bearer.{TOKEN}",)), ((), (f"bearer.{TOKEN}", f"bearer.{TOKEN}"))])
def test_a_websocket_without_one_right_token_is_401_before_the_app(headers, subprotocols):
    guard, seen = _guard()
    before = _count("/v1/socket/{name}", "401")
    wire = _socket(guard, headers, subprotocols)
    assert wire.types == ["websocket.http.response.start", "websocket.http.response.body"] and not seen
    start, body = wire.sent
    assert start["status"] == 401 and dict(start["headers"])[b"www-authenticate"] == b"Bearer"
    assert json.loads(body["body"])["error"]["code"] == "invalid_api_key"
    assert TOKEN not in body["body"].decode()
    assert _count("/v1/socket/{name}", "401") == before + 1 and guard.in_flight == 0


def test_a_websocket_token_as_header_or_subprotocol_and_the_subprotocol_echoed():
    guard, seen = _guard()
    by_header = _socket(guard, AUTH, ("chat",))
    assert by_header.types[0] == "websocket.accept" and by_header.sent[0].get("subprotocol") is None
    before = _count("/v1/socket/{name}", "101")
    by_subprotocol = _socket(guard, (), ("chat", f"bearer.{TOKEN}"))
    assert by_subprotocol.sent[0] == {"type": "websocket.accept", "subprotocol": f"bearer.{TOKEN}",
                                      "headers": []}
    assert by_subprotocol.sent[1] == {"type": "websocket.send", "text": "x"} and seen == ["x", "x"]
    assert _count("/v1/socket/{name}", "101") == before + 1


def test_a_websocket_is_closed_before_the_accept_where_http_denial_is_not_supported():
    guard, seen = _guard()
    assert _socket(guard, denial=False).sent == [{"type": "websocket.close", "code": 1008}] and not seen
    guard.draining = True
    assert _socket(guard, AUTH, denial=False).sent == [{"type": "websocket.close", "code": 1013}]


def test_draining_refuses_a_websocket_with_503_and_counts_it_in_flight_while_open():
    guard, seen = _guard(token=None)
    guard.draining = True
    wire = _socket(guard)
    assert wire.sent[0]["type"] == "websocket.http.response.start" and wire.sent[0]["status"] == 503
    assert not seen
    guard.draining = False
    counts = []

    async def app(scope, receive, send):
        counts.append(guard.in_flight)
        await send({"type": "websocket.accept"})

    guard.app = app
    _socket(guard)
    assert counts == [1] and guard.in_flight == 0
