"""Domain errors: what went wrong, in the words of the service, without gRPC.

Engines, schedulers and validators raise these; one server interceptor
(:mod:`services.common.server`) turns them into gRPC status codes, so code below the
servicers never imports grpc. ``code`` is the name of a ``grpc.StatusCode`` member;
``error_code`` is the client's word for the error (services/common/error_codes.py: HTTP's
``error.code``, the WebSocket's, gRPC's ``ErrorInfo.reason``), its class's unless the raiser
names a more precise one; ``field`` is the request field at fault, if one is.
"""

from __future__ import annotations

from services.common import error_codes


class ServiceError(Exception):
    """Base class; ``code`` names the gRPC status the client receives."""

    code = "INTERNAL"
    error_code = error_codes.INTERNAL_ERROR

    def __init__(self, message: str, *, field: str | None = None, error_code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if error_code is not None:
            self.error_code = error_code


class InvalidArgument(ServiceError):
    """A request field is wrong; ``field`` is its name as the client spelled it."""

    code = "INVALID_ARGUMENT"
    error_code = error_codes.INVALID_VALUE

    def __init__(self, field: str, reason: str, *, error_code: str | None = None) -> None:
        super().__init__(f"{field}: {reason}", field=field, error_code=error_code)
        self.reason = reason


class AlreadyExists(ServiceError):
    code = "ALREADY_EXISTS"
    error_code = error_codes.ALREADY_EXISTS


class NotFound(ServiceError):
    code = "NOT_FOUND"
    error_code = error_codes.NOT_FOUND


class ResourceExhausted(ServiceError):
    """No capacity now; ``retry_after`` (seconds) travels as the "retry-after-s" trailer."""

    code = "RESOURCE_EXHAUSTED"
    error_code = error_codes.RATE_LIMIT_EXCEEDED

    def __init__(self, message: str, retry_after: float | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class Unavailable(ServiceError):
    code = "UNAVAILABLE"
    error_code = error_codes.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"
    error_code = error_codes.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = "CANCELLED"
    error_code = error_codes.CANCELLED


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"
    error_code = error_codes.FAILED_PRECONDITION


class Unimplemented(ServiceError):
    code = "UNIMPLEMENTED"
    error_code = error_codes.UNIMPLEMENTED


class Internal(ServiceError):
    code = "INTERNAL"
