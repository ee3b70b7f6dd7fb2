"""Errors of the HTTP API in OpenAI's shape, and which HTTP status each domain error gets.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` as OpenAI's API
sends it, so the official clients raise their usual exceptions (BadRequestError, ...).
Domain errors (services.common.errors) name fields the way the gRPC API spells them; here
``param`` names the field of the HTTP request instead (``text`` is ``input``, ...), or of the
WebSocket's JSON messages (``config.voice_name`` is ``voice``, ...). ``code`` is the word of
services/common/error_codes.py, the same as the WebSocket's and gRPC's ``ErrorInfo.reason``
(docs/errors.md).

The statuses follow Google's canonical mapping of gRPC codes to HTTP, except where
OpenAI's API defines another: FAILED_PRECONDITION is 400 (the request cannot be served in
the server's current state, e.g. uploads are off), ALREADY_EXISTS is 409.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from fastapi import params
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from services.common import error_codes as codes
from services.common.errors import InvalidArgument, ResourceExhausted, ServiceError

log = logging.getLogger(__name__)

# gRPC field names of SynthesizeSpeechRequest -> the JSON body's names
HTTP_FIELDS = {"text": "input", "voice_name": "voice", "sample_rate_hz": "sample_rate",
               "encoding": "response_format",
               "audio": "file"}  # CreateVoice's clip: the multipart part of POST /v1/audio/voices

# StreamingSynthesize's names (StreamingConfig's as ``config.<field>``, the message's oneof ``kind``)
# -> the JSON names of /v1/audio/speech/stream's messages (speech_stream.py)
WS_FIELDS = {"voice_name": "voice", "sample_rate_hz": "sample_rate", "encoding": "response_format",
             "language_code": "language", "kind": "type"}

STATUS_OF_CODE = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
    "ABORTED": 409, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "INTERNAL": 500,
    "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for a status."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def http_param(field: str | None) -> str | None:
    return None if field is None else HTTP_FIELDS.get(field, field)


def ws_param(field: str | None) -> str | None:
    """A session's field as the WebSocket's messages name it: ``config.voice_name`` -> ``voice``,
    ``config.seed`` -> ``seed``, ``config`` (the first message) and ``text`` as they are."""
    if field is None:
        return None
    name = field.removeprefix("config.")
    return WS_FIELDS.get(name, name)


def retry_after_header(seconds: float | None) -> dict[str, str]:
    """Retry-After takes whole seconds (RFC 9110): a fraction rounds up, never to 0."""
    if seconds is None or not math.isfinite(seconds):
        return {}
    return {"Retry-After": str(max(1, math.ceil(seconds)))}



def service_error_parts(exc: ServiceError, param_of: Callable[[str | None], str | None] = http_param
                        ) -> tuple[int, str, str | None, dict[str, str]]:
    """(status, message, param, headers) of a domain error, its field in HTTP's words
    (``param_of``: http_param for the HTTP bodies, ws_param for the WebSocket's messages); its
    code is ``exc.error_code``."""
    status = STATUS_OF_CODE.get(exc.code, 500)
    param = param_of(exc.field)
    message = exc.message
    if isinstance(exc, InvalidArgument) and param != exc.field:
        message = f"{param}: {exc.reason}"
    headers = retry_after_header(exc.retry_after) if isinstance(exc, ResourceExhausted) else {}
    return status, message, param, headers


def service_error_response(exc: ServiceError) -> JSONResponse:
    status, message, param, headers = service_error_parts(exc)
    level = logging.ERROR if status >= 500 and status != 503 else logging.INFO
    log.log(level, "HTTP -> %d %s: %s", status, exc.error_code, message)
    return error_response(status, message, param, exc.error_code, headers)


NEWLINE = "\n"


def json_position(doc: str, pos: int) -> str:
    """``line L, column C`` (both from 1) of character ``pos`` of ``doc``."""
    line = doc.count("\n", 0, pos) + 1
    return f"line {line}, column {pos - doc.rfind(NEWLINE, 0, pos)}"


def _not_json_message(problem: dict, doc) -> str:
    reason = (problem.get("ctx") or {}).get("error", "invalid JSON")
    pos = problem["loc"][1] if len(problem.get("loc", ())) > 1 else None
    if isinstance(doc, bytes):
        doc = doc.decode("utf-8", "replace")
    where = f" ({json_position(doc, pos)})" if isinstance(doc, str) and isinstance(pos, int) else ""
    return f"the body is not valid JSON: {reason}{where}"


def validation_error_parts(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) of the first problem pydantic/FastAPI found in a request: the
    param is the top-level field it is about (a body field, a form field or a path part)."""
    problems = exc.errors()
    if not problems:
        return "invalid request", None, codes.INVALID_VALUE
    first = problems[0]
    kind = first.get("type")
    if kind == "json_invalid":
        return _not_json_message(first, getattr(exc, "body", None)), None, codes.INVALID_JSON
    loc = [str(part) for part in first.get("loc", ())]
    param = loc[1] if len(loc) > 1 and loc[0] in ("body", "path", "query", "header") else None
    if param is not None and param.isdigit():  # an item of a body that is a list
        param = None
    message, code = first.get("msg", "invalid value"), codes.INVALID_VALUE
    if param is None and kind in ("model_attributes_type", "model_type", "dict_type", "list_type"):
        message, code = "the body must be a JSON object", codes.INVALID_JSON
    elif param is None and kind == "missing":
        message, code = "the request needs a JSON body", codes.INVALID_JSON
    elif kind == "extra_forbidden":
        message, code = "unknown field (not part of this API)", codes.UNKNOWN_PARAMETER
    elif kind == "missing":
        code = codes.MISSING_REQUIRED_PARAMETER
    return (f"{param}: {message}" if param else message), param, code


JSON = "application/json"
FORM = ("multipart/form-data", "application/x-www-form-urlencoded")


def accepted_media_type(request: Request) -> str | None:
    """The media type the request's route takes its body in (None: no body)."""
    field = getattr(request.scope.get("route"), "body_field", None)
    if field is None:
        return None
    return FORM[0] if isinstance(field.field_info, params.Form) else JSON


def media_type_problem(request: Request, exc: RequestValidationError) -> str | None:
    """The 415's message when the body's Content-Type is not the one the route takes (FastAPI
    then validates the raw bytes, or an empty form), else None."""
    accepted = accepted_media_type(request)
    given = request.headers.get("content-type")
    if accepted is None:
        return None
    if given is None:  # a body without a Content-Type is read as bytes, not as JSON
        if accepted != JSON or not any(isinstance(p.get("input"), bytes) for p in exc.errors()):
            return None
    else:
        kind = given.split(";", 1)[0].strip().lower()
        ok = kind in FORM if accepted != JSON else (kind == JSON or (
            kind.startswith("application/") and kind.endswith("+json")))
        if ok:
            return None
    return f"Content-Type must be {accepted}, got {given or 'none'}"


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    wrong_type = media_type_problem(request, exc)
    if wrong_type is not None:
        return error_response(415, wrong_type, None, codes.UNSUPPORTED_MEDIA_TYPE)
    message, param, code = validation_error_parts(exc)
    return error_response(400, message, param, code)


async def on_service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return service_error_response(exc)


HTTP_EXCEPTION_CODES = {404: codes.NOT_FOUND, 405: codes.METHOD_NOT_ALLOWED, 413: codes.REQUEST_TOO_LARGE}


async def on_http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals in OpenAI's shape: no such route (404), a wrong method (405), a
    body FastAPI could not parse (400: JSON that is not UTF-8, a broken multipart body)."""
    code = HTTP_EXCEPTION_CODES.get(exc.status_code)
    if exc.status_code == 400:
        code = codes.INVALID_JSON if accepted_media_type(request) == JSON else codes.INVALID_VALUE
    return error_response(exc.status_code, str(exc.detail), None, code, dict(exc.headers or {}))


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("%s %s failed with an unexpected error", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}", None, codes.INTERNAL_ERROR)
