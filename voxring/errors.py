"""Typed errors of the Python SDK: one class per status code the public API documents.

Every ``grpc.RpcError`` that reaches the SDK leaves it as a :class:`VoxringError` (a
subclass where the code has one), with the server's message and what its trailing
metadata says: the field at fault ("voxring-field"), a retry hint ("retry-after-s", seconds)
and the error's ``reason``, the word of docs/errors.md that the HTTP API sends as
``error.code`` ("invalid_value", "already_exists", "unavailable", ...), read from the
``google.rpc.ErrorInfo`` of the rich status details. This module does not import grpc, so the
CLI can catch these errors without loading grpc before it spawns processes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

FIELD_METADATA = "voxring-field"
RETRY_AFTER_METADATA = "retry-after-s"
DETAILS_METADATA = "grpc-status-details-bin"
DOMAIN = "voxring.dev"

# "temperature: must be >= 0": the gateway names the field first in the message.
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): ")


class VoxringError(Exception):
    """A failed call. ``code`` is the gRPC status code's name ("INVALID_ARGUMENT");
    ``field`` names the request field at fault; ``retry_after`` is the server's hint, in
    seconds, of when a retry may succeed; ``reason`` is the error's code in docs/errors.md's
    words ("invalid_value"; None from a server that sends none)."""

    def __init__(self, code: str, message: str, field: str | None = None,
                 retry_after: float | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after
        self.reason = reason

    @property
    def status_code(self) -> Any:
        """The code as a ``grpc.StatusCode`` (imports grpc)."""
        import grpc

        return grpc.StatusCode[self.code]

    def describe(self) -> str:
        """One line for people: the code, the message, the field and the retry hint."""
        text = f"{self.code}: {self.message}"
        if self.field and not self.message.startswith(f"{self.field}:"):
            text += f" (field {self.field})"
        if self.retry_after is not None:
            text += f" (retry after {self.retry_after:g} s)"
        return text

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, "
                f"field={self.field!r}, retry_after={self.retry_after!r}, reason={self.reason!r})")


class _Coded(VoxringError):
    """A VoxringError whose class fixes the code."""

    CODE = "UNKNOWN"

    def __init__(self, message: str, field: str | None = None,
                 retry_after: float | None = None, reason: str | None = None) -> None:
        super().__init__(self.CODE, message, field=field, retry_after=retry_after, reason=reason)


class InvalidArgument(_Coded):
    """A request field is wrong; ``field`` names it."""

    CODE = "INVALID_ARGUMENT"


class AlreadyExists(_Coded):
    """A request with this ``request_id`` is already in flight."""

    CODE = "ALREADY_EXISTS"


class NotFound(_Coded):
    """The named thing (a voice) does not exist."""

    CODE = "NOT_FOUND"


class FailedPrecondition(_Coded):
    """The server cannot do this in its state or configuration (a voice of its voices file
    cannot be removed; no folder for added voices)."""

    CODE = "FAILED_PRECONDITION"


class ResourceExhausted(_Coded):
    """The server has no capacity now; ``retry_after`` may say when to try again."""

    CODE = "RESOURCE_EXHAUSTED"


class Cancelled(_Coded):
    """The call was cancelled by the server or a stage (a local ``cancel()`` ends a
    stream quietly instead)."""

    CODE = "CANCELLED"


class DeadlineExceeded(_Coded):
    """The call's deadline (``timeout=``) passed."""

    CODE = "DEADLINE_EXCEEDED"


class Unavailable(_Coded):
    """The server cannot be reached, is draining, or lost a stage."""

    CODE = "UNAVAILABLE"


class Unauthenticated(_Coded):
    """The server wants a bearer token (``token=``) and got none, or another one."""

    CODE = "UNAUTHENTICATED"


class InternalError(_Coded):
    """The server failed on this request (or answered against the protocol)."""

    CODE = "INTERNAL"


_BY_CODE: dict[str, type[_Coded]] = {cls.CODE: cls for cls in (
    InvalidArgument, AlreadyExists, NotFound, FailedPrecondition, ResourceExhausted, Cancelled,
    DeadlineExceeded, Unavailable, Unauthenticated, InternalError)}


def _metadata_value(metadata: Iterable[Any] | None, key: str) -> str | None:
    """The last value of ``key`` in gRPC metadata (pairs; values str or bytes)."""
    found = None
    for item in metadata or ():
        name, value = item[0], item[1]
        if name == key:
            found = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return found


def _parse_retry_after(text: str | None) -> float | None:
    try:
        seconds = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _reason(metadata: Iterable[Any] | None) -> str | None:
    """ErrorInfo.reason of the ``grpc-status-details-bin`` trailer (voxring's domain), if any."""
    blobs = [item[1] for item in metadata or () if item[0] == DETAILS_METADATA and isinstance(item[1], bytes)]
    if not blobs:
        return None
    from google.protobuf.message import DecodeError
    from google.rpc import error_details_pb2, status_pb2

    status, info = status_pb2.Status(), error_details_pb2.ErrorInfo()
    try:
        status.ParseFromString(blobs[-1])
    except DecodeError:
        return None
    for detail in status.details:
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == DOMAIN:
            return info.reason or None
    return None


def error_from_status(code: str, message: str,
                      trailing_metadata: Iterable[Any] | None = None) -> VoxringError:
    """The typed error for a status code name, its details and trailing metadata."""
    field = _metadata_value(trailing_metadata, FIELD_METADATA)
    if code == "INVALID_ARGUMENT" and not field:
        # A proxy may drop trailing metadata; the message still starts with the field.
        match = _FIELD_PREFIX.match(message)
        field = match.group(1) if match else None
    retry_after = _parse_retry_after(_metadata_value(trailing_metadata, RETRY_AFTER_METADATA))
    reason = _reason(trailing_metadata)
    cls = _BY_CODE.get(code)
    if cls is None:
        return VoxringError(code, message, field=field or None, retry_after=retry_after, reason=reason)
    return cls(message, field=field or None, retry_after=retry_after, reason=reason)


def error_from_rpc(exc: BaseException) -> VoxringError:
    """Maps a ``grpc.RpcError`` (sync or ``grpc.aio``) to its typed error."""
    code_fn = getattr(exc, "code", None)
    code = code_fn() if callable(code_fn) else None
    name = getattr(code, "name", None) or "UNKNOWN"
    details_fn = getattr(exc, "details", None)
    message = (details_fn() if callable(details_fn) else None) or str(exc) or name
    trailing_fn = getattr(exc, "trailing_metadata", None)
    trailing = trailing_fn() if callable(trailing_fn) else None
    return error_from_status(name, message, trailing)
