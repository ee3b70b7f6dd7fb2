"""gRPC's rich error model for voxring's errors: each error status carries a ``google.rpc.Status``
in the ``grpc-status-details-bin`` trailer whose one detail is a ``google.rpc.ErrorInfo``:
``reason`` is the code of services/common/error_codes.py (the HTTP API's ``error.code``),
``domain`` is ``voxring.dev`` and ``metadata["field"]`` the request field at fault, if one is.

The plain trailers stay beside it (``voxring-field``, ``retry-after-s``), so clients without the
googleapis protos read what they read before. :func:`abort` ends a call so; :func:`error_info`
reads a status back (the gateway tells its stages' own errors from the transport's by it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.common.error_codes import DOMAIN, OF_STATUS

FIELD_METADATA = "voxring-field"
RETRY_AFTER_METADATA = "retry-after-s"
DETAILS_METADATA = "grpc-status-details-bin"


def trailers(code: str, message: str, reason: str | None = None, field: str | None = None,
             retry_after: float | None = None) -> tuple[tuple[str, Any], ...]:
    """The trailing metadata of an error status: ``code`` a ``grpc.StatusCode`` name, ``reason``
    the error code (by default the one of the status code)."""
    info = error_details_pb2.ErrorInfo(reason=reason or OF_STATUS.get(code, "internal_error"),
                                       domain=DOMAIN, metadata={"field": field} if field else {})
    status = status_pb2.Status(code=grpc.StatusCode[code].value[0], message=message)
    status.details.add().Pack(info)
    out: list[tuple[str, Any]] = list(rpc_status.to_status(status).trailing_metadata)
    if field:
        out.append((FIELD_METADATA, field))
    if retry_after is not None and math.isfinite(retry_after):
        out.append((RETRY_AFTER_METADATA, f"{retry_after:g}"))
    return tuple(out)


async def abort(context: grpc.aio.ServicerContext, code: str, message: str, reason: str | None = None,
                field: str | None = None, retry_after: float | None = None) -> None:
    """Ends the call with status ``code`` (a name), ``message`` and the trailers above."""
    context.set_trailing_metadata(trailers(code, message, reason, field, retry_after))
    await context.abort(grpc.StatusCode[code], message)


def error_info(trailing_metadata: Iterable[Any] | None) -> error_details_pb2.ErrorInfo | None:
    """The voxring ErrorInfo of a status's trailing metadata, or None (none there: the error
    came from the transport or from a server that is not voxring's)."""
    for key, value in trailing_metadata or ():
        if key != DETAILS_METADATA or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except DecodeError:  # a malformed trailer is no ErrorInfo
            return None
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == DOMAIN:
                return info
    return None
