"""The calls of a stage's gRPC server (:class:`services.common.server.ServiceHost`): the one
interceptor that turns :class:`~services.common.errors.ServiceError` into status codes (with the
error code as ErrorInfo.reason, the field and the retry-after trailers), tags each call's log
lines with its request id, refuses new calls while the host drains, and counts the calls in
flight so the drain can wait for them or end them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any

import grpc

from services.common import error_codes, rich_status
from services.common.errors import ServiceError
from services.common.log import request_context
from services.common.metrics import RPC_ERRORS
from services.common.rich_status import FIELD_METADATA, RETRY_AFTER_METADATA

log = logging.getLogger("services.common.server")  # the host's logger: its lines keep their name

# Infrastructure services are never refused while draining and are not counted as
# in-flight work.
_INFRA_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
REQUEST_ID_METADATA = "x-request-id"


class CallTracker:
    """Counts calls in flight and lets the drain wait for them or end them."""

    def __init__(self) -> None:
        self.accepting = True
        self.abandoning = False
        self._tasks: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self):
        task = asyncio.current_task()
        self._tasks.add(task)
        self._idle.clear()
        try:
            yield
        finally:
            self._tasks.discard(task)
            if not self._tasks:
                self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def abandon(self) -> None:
        """Ends every call still in flight; each answers UNAVAILABLE."""
        self.abandoning = True
        for task in list(self._tasks):
            task.cancel()


def _request_id_of(request: Any, context: grpc.aio.ServicerContext) -> str:
    rid = getattr(request, "request_id", "") if request is not None else ""
    if rid:
        return rid
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA:
            return value
    return "-"


async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
    """The error's status, with its code as ErrorInfo.reason and its field and retry hint
    (services/common/rich_status.py)."""
    await rich_status.abort(context, exc.code, exc.message, exc.error_code, exc.field,
                            getattr(exc, "retry_after", None))


class CallInterceptor(grpc.aio.ServerInterceptor):
    """The one place domain errors become status codes; also tracks calls in flight,
    refuses new calls while draining, and sets the request id for logging."""

    def __init__(self, tracker: CallTracker, drain_exempt: frozenset[str] = frozenset()) -> None:
        self._tracker = tracker
        self._drain_exempt = drain_exempt

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_INFRA_PREFIXES) or method in self._drain_exempt:
            return handler
        if handler.unary_unary:
            wrapped = self._wrap_unary(handler.unary_unary, method)
            factory = grpc.unary_unary_rpc_method_handler
        elif handler.unary_stream:
            wrapped = self._wrap_stream(handler.unary_stream, method)
            factory = grpc.unary_stream_rpc_method_handler
        elif handler.stream_unary:
            wrapped = self._wrap_unary(handler.stream_unary, method, streaming_request=True)
            factory = grpc.stream_unary_rpc_method_handler
        else:
            wrapped = self._wrap_stream(handler.stream_stream, method, streaming_request=True)
            factory = grpc.stream_stream_rpc_method_handler
        return factory(wrapped, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)

    async def _on_error(self, exc: BaseException, context, method: str) -> None:
        code = (exc.code if isinstance(exc, ServiceError) else "UNAVAILABLE"
                if isinstance(exc, asyncio.CancelledError) else "INTERNAL")
        if not (isinstance(exc, asyncio.CancelledError) and not self._tracker.abandoning):
            RPC_ERRORS.labels(method, code).inc()
        if isinstance(exc, ServiceError):
            level = logging.ERROR if exc.code == "INTERNAL" else logging.INFO
            log.log(level, "%s -> %s: %s", method, exc.code, exc.message)
            await _abort(context, exc)
        elif isinstance(exc, asyncio.CancelledError) and self._tracker.abandoning:
            await rich_status.abort(context, "UNAVAILABLE", "server shut down before this request finished")
        elif isinstance(exc, asyncio.CancelledError):
            raise exc
        else:
            log.exception("%s failed with an unexpected error", method)
            await rich_status.abort(context, "INTERNAL", f"internal error: {type(exc).__name__}",
                                    error_codes.INTERNAL_ERROR)

    async def _refuse_if_draining(self, context) -> None:
        if not self._tracker.accepting:
            RPC_ERRORS.labels("draining", "UNAVAILABLE").inc()
            await rich_status.abort(context, "UNAVAILABLE",
                                    "server is shutting down; retry on another instance")

    def _wrap_unary(self, fn, method: str, streaming_request: bool = False):
        async def wrapper(request, context):
            rid = "-" if streaming_request else _request_id_of(request, context)
            with self._tracker.track(), request_context(rid):
                await self._refuse_if_draining(context)
                try:
                    return await fn(request, context)
                except (ServiceError, asyncio.CancelledError, Exception) as exc:
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await self._on_error(exc, context, method)
        return wrapper

    def _wrap_stream(self, fn, method: str, streaming_request: bool = False):
        async def wrapper(request, context):
            rid = "-" if streaming_request else _request_id_of(request, context)
            with self._tracker.track(), request_context(rid):
                await self._refuse_if_draining(context)
                try:
                    if inspect.isasyncgenfunction(fn):
                        async for response in fn(request, context):
                            yield response
                    else:
                        await fn(request, context)
                except (ServiceError, asyncio.CancelledError, Exception) as exc:
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await self._on_error(exc, context, method)
        return wrapper


__all__ = ["FIELD_METADATA", "REQUEST_ID_METADATA", "RETRY_AFTER_METADATA", "CallInterceptor", "CallTracker"]
