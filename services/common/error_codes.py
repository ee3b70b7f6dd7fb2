"""The one vocabulary of error codes, the same word on every surface: the HTTP API's
``error.code`` (OpenAI's error shape), the WebSocket's ``error`` event and close reason, and the
gRPC API's ``google.rpc.ErrorInfo.reason`` (domain :data:`DOMAIN`) in the rich status details.

A code says what the client can do about the error; the HTTP status and the gRPC status code say
how bad it is. docs/errors.md lists which input gets which code, and
tests/integration/test_error_table.py holds the servers to it. Where OpenAI's API has a code for
the same situation, this is its word (invalid_value, missing_required_parameter,
unknown_parameter, model_not_found, invalid_api_key, rate_limit_exceeded).
"""

from __future__ import annotations

DOMAIN = "voxring.dev"  # ErrorInfo.domain: the codes below are voxring's

# --- the request's fault: fix it before sending it again --------------------------------------
INVALID_VALUE = "invalid_value"                          # a field's value: type, range, unknown name
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"  # a required field is absent
UNKNOWN_PARAMETER = "unknown_parameter"                  # a field this API does not have
INVALID_JSON = "invalid_json"                            # the body (a message) is not a JSON object
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"        # the Content-Type is not the one accepted
REQUEST_TOO_LARGE = "request_too_large"                  # the body is over http.max_body_mb
FAILED_PRECONDITION = "failed_precondition"              # not in this server's state or configuration
INVALID_API_KEY = "invalid_api_key"                      # no bearer token, or another one
NOT_FOUND = "not_found"                                  # no such route (or thing)
MODEL_NOT_FOUND = "model_not_found"                      # no such model (param "model")
VOICE_NOT_FOUND = "voice_not_found"                      # no such voice (param "name")
METHOD_NOT_ALLOWED = "method_not_allowed"
ALREADY_EXISTS = "already_exists"                        # a request_id in flight, a voice name taken
UNIMPLEMENTED = "unimplemented"

# --- the server's state: the same request may succeed later ------------------------------------
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"              # no capacity now; retry after the hint
UNAVAILABLE = "unavailable"                              # a stage (or the server) cannot serve now
DEADLINE_EXCEEDED = "deadline_exceeded"
CANCELLED = "cancelled"
INTERNAL_ERROR = "internal_error"

# the code of each gRPC status code, where an error says no more precise one
OF_STATUS = {
    "INVALID_ARGUMENT": INVALID_VALUE, "OUT_OF_RANGE": INVALID_VALUE,
    "FAILED_PRECONDITION": FAILED_PRECONDITION, "UNAUTHENTICATED": INVALID_API_KEY,
    "PERMISSION_DENIED": INVALID_API_KEY, "NOT_FOUND": NOT_FOUND, "ALREADY_EXISTS": ALREADY_EXISTS,
    "ABORTED": ALREADY_EXISTS, "RESOURCE_EXHAUSTED": RATE_LIMIT_EXCEEDED, "CANCELLED": CANCELLED,
    "UNIMPLEMENTED": UNIMPLEMENTED, "UNAVAILABLE": UNAVAILABLE, "DEADLINE_EXCEEDED": DEADLINE_EXCEEDED,
    "INTERNAL": INTERNAL_ERROR, "UNKNOWN": INTERNAL_ERROR, "DATA_LOSS": INTERNAL_ERROR,
}

ALL = frozenset(value for name, value in globals().items() if name.isupper() and isinstance(value, str)
                and name != "DOMAIN")
