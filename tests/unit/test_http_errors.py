"""The HTTP API's error mapping: domain errors to statuses in OpenAI's shape, field names
back to the HTTP body's, pydantic's complaints to the field they are about."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from services.common import error_codes, errors
from services.gateway.http.errors import (
    error_body,
    retry_after_header,
    service_error_parts,
    service_error_response,
    validation_error_parts,
)
from services.gateway.http.speech import SpeechBody


@pytest.mark.parametrize(("exc", "status"), [
    (errors.InvalidArgument("top_p", "bad"), 400), (errors.FailedPrecondition("off"), 400),
    (errors.NotFound("no"), 404), (errors.AlreadyExists("dup"), 409),
    (errors.ResourceExhausted("busy", retry_after=0.2), 429), (errors.Unavailable("down"), 503),
    (errors.DeadlineExceeded("late"), 504), (errors.Internal("bug"), 500),
])
def test_domain_errors_get_their_status(exc, status):
    assert service_error_parts(exc)[0] == status


@pytest.mark.parametrize(("grpc_field", "http_field"), [
    ("text", "input"), ("voice_name", "voice"), ("sample_rate_hz", "sample_rate"),
    ("encoding", "response_format"), ("top_k", "top_k"), ("speed", "speed"), ("audio", "file")])
def test_invalid_argument_names_the_http_field(grpc_field, http_field):
    status, message, param, _ = service_error_parts(errors.InvalidArgument(grpc_field, "is wrong"))
    assert (status, param, message) == (400, http_field, f"{http_field}: is wrong")


def test_retry_after_is_whole_seconds_never_zero():
    assert retry_after_header(0.2) == {"Retry-After": "1"}
    assert retry_after_header(2.5) == {"Retry-After": "3"}
    assert retry_after_header(None) == {}
    assert service_error_parts(errors.ResourceExhausted("busy", retry_after=4))[3] == {"Retry-After": "4"}


def test_error_body_is_openais_shape():
    assert error_body(429, "busy", None, "rate_limit_exceeded") == {"error": {
        "message": "busy", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
    assert error_body(503, "down")["error"]["type"] == "server_error"
    assert error_body(404, "no")["error"]["type"] == "invalid_request_error"


def _problem(body: dict) -> tuple[str, str | None, str]:
    with pytest.raises(ValidationError) as caught:
        SpeechBody.model_validate(body)
    errs = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    return validation_error_parts(RequestValidationError(errs))


BASE = {"model": "tts-1", "input": "hi", "voice": "default"}


@pytest.mark.parametrize(("field", "value"), [
    ("speed", "fast"), ("speed", "1.5"), ("seed", -1), ("seed", 2**64), ("top_k", 2**31), ("top_k", 1.5),
    ("voice", 3), ("voice", {"id": 3}), ("voice", {"name": "x"}), ("response_format", "ogg"),
    ("stream_format", "chunks"), ("model", ""), ("request_id", 5), ("colour", "blue")])
def test_pydantic_problems_name_the_top_level_field(field, value):
    message, param, code = _problem({**BASE, field: value})
    assert param == field and message.startswith(f"{field}: ")
    assert code == ("unknown_parameter" if field == "colour" else "invalid_value")


def test_unknown_fields_are_called_unknown():
    assert _problem({**BASE, "colour": "blue"}) == ("colour: unknown field (not part of this API)", "colour",
                                                    "unknown_parameter")


def test_a_missing_field_is_named_and_coded_missing():
    body = dict(BASE)
    del body["input"]
    assert _problem(body) == ("input: Field required", "input", "missing_required_parameter")


def test_a_missing_body_names_no_field():
    message, param, code = validation_error_parts(RequestValidationError(
        [{"type": "missing", "loc": ("body",), "msg": "Field required"}]))
    assert param is None and "JSON body" in message and code == "invalid_json"


@pytest.mark.parametrize(("doc", "where"), [
    ('{"model": "tts-1",}', "line 1, column 19"), ('{\n  "input": "hi"\n  "voice": 1}', "line 3, column 3"),
    ("", "line 1, column 1")])
def test_malformed_json_names_its_line_and_column(doc, where):
    try:
        json.loads(doc)
    except json.JSONDecodeError as exc:
        problem = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                   "ctx": {"error": exc.msg}}
    message, param, code = validation_error_parts(RequestValidationError([problem], body=doc))
    assert (param, code) == (None, "invalid_json")
    assert message.startswith("the body is not valid JSON: ") and message.endswith(f"({where})"), message


def test_a_body_that_is_not_an_object_is_invalid_json():
    message, param, code = validation_error_parts(RequestValidationError(
        [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary",
          "input": [1]}]))
    assert (message, param, code) == ("the body must be a JSON object", None, "invalid_json")


@pytest.mark.parametrize(("exc", "code", "param"), [
    (errors.InvalidArgument("text", "empty"), "invalid_value", "input"),
    (errors.AlreadyExists("request_id: 'r' is already in flight", field="request_id"), "already_exists",
     "request_id"),
    (errors.NotFound("name: no voice 'x'", field="name", error_code="voice_not_found"), "voice_not_found",
     "name"),
    (errors.ResourceExhausted("busy", retry_after=1), "rate_limit_exceeded", None),
    (errors.Unavailable("down"), "unavailable", None), (errors.Internal("bug"), "internal_error", None),
])
def test_domain_errors_carry_their_code_and_field(exc, code, param):
    body = json.loads(service_error_response(exc).body)["error"]
    assert (body["code"], body["param"]) == (code, param)
    assert body["code"] in error_codes.ALL
