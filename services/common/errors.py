"""Domain errors: what went wrong, in the words of the service, without gRPC.

Engines, schedulers and validators raise these; one server interceptor
(:mod:`services.common.server`) turns them into gRPC status codes, so code below the
servicers never imports grpc. ``code`` is the name of a ``grpc.StatusCode`` member.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class; ``code`` names the gRPC status the client receives."""

    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    """A request field is wrong; ``field`` is its name as the client spelled it."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class AlreadyExists(ServiceError):
    code = "ALREADY_EXISTS"


class NotFound(ServiceError):
    code = "NOT_FOUND"


class ResourceExhausted(ServiceError):
    """No capacity now; ``retry_after`` (seconds) travels as the "retry-after-s" trailer."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(ServiceError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(ServiceError):
    code = "CANCELLED"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class Unimplemented(ServiceError):
    code = "UNIMPLEMENTED"


class Internal(ServiceError):
    code = "INTERNAL"
