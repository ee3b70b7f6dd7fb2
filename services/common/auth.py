"""Bearer-token authentication for a stage's server (the gateway's ``auth.token_file``).

:class:`BearerTokenInterceptor` requires the metadata ``authorization: Bearer <token>``
on every call except the standard health service (container probes and load balancers
check it without credentials). Reflection needs the token too. A call without it, or
with another token, ends UNAUTHENTICATED before any servicer runs. The token is compared
in constant time and never logged, neither the expected one nor what a caller sent.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

import grpc

from services.common import error_codes, rich_status
from services.common.config import ConfigError
from services.common.metrics import RPC_ERRORS

log = logging.getLogger(__name__)

AUTHORIZATION_METADATA = "authorization"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
_SCHEME = "bearer"  # RFC 6750; the scheme name is case-insensitive (RFC 9110)


def read_token_file(path: Path, where: str = "auth.token_file") -> str:
    """The token in ``path``: the file's content without surrounding whitespace. A
    missing, unreadable or empty file, or a token a gRPC metadata value cannot carry
    (anything but printable ASCII without spaces), is a :class:`ConfigError` naming
    ``where``; its message never contains the token."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {str(path)!r}: the token must be printable ASCII") from None
    if not token:
        raise ConfigError(f"{where}: {str(path)!r} is empty; it must hold the bearer token")
    if not all("!" <= ch <= "~" for ch in token):
        raise ConfigError(f"{where}: {str(path)!r}: the token must be one word of printable "
                          f"ASCII (no spaces, tabs or line breaks inside it)")
    return token


def _deny_handler(kind: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``kind`` that ends the call UNAUTHENTICATED."""

    async def deny(request_or_iterator, context):
        await rich_status.abort(context, "UNAUTHENTICATED", message, error_codes.INVALID_API_KEY)

    if kind.unary_unary:
        factory = grpc.unary_unary_rpc_method_handler
    elif kind.unary_stream:
        factory = grpc.unary_stream_rpc_method_handler
    elif kind.stream_unary:
        factory = grpc.stream_unary_rpc_method_handler
    else:
        factory = grpc.stream_stream_rpc_method_handler
    return factory(deny, request_deserializer=kind.request_deserializer,
                   response_serializer=kind.response_serializer)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health without ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._expected = token.encode("ascii")

    def __repr__(self) -> str:  # never show the token
        return f"{type(self).__name__}(token=<hidden>)"

    def _problem(self, metadata) -> str | None:
        """None when the call carries the token, else what the caller is told."""
        values = [value for key, value in metadata or () if key == AUTHORIZATION_METADATA]
        if not values:
            return "missing credentials: send the metadata 'authorization: Bearer <token>'"
        if len(values) > 1:
            return "more than one 'authorization' metadata entry"
        value = values[0]
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        scheme, _, presented = value.strip().partition(" ")
        if scheme.lower() != _SCHEME or not presented.strip():
            return "the 'authorization' metadata must be 'Bearer <token>'"
        if not hmac.compare_digest(presented.strip().encode("utf-8"), self._expected):
            return "invalid bearer token"
        return None

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        problem = self._problem(handler_call_details.invocation_metadata)
        if problem is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: UNIMPLEMENTED, as without auth
            return None
        RPC_ERRORS.labels(method, "UNAUTHENTICATED").inc()
        log.info("%s -> UNAUTHENTICATED: %s", method, problem)
        return _deny_handler(handler, problem)
