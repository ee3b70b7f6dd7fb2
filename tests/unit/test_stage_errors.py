"""A stage's error status as the gateway's client reads it (stage_errors.stage_error): which stage of
which pair failed, the stage's own message when the stage wrote it (its status carries voxring's
ErrorInfo), never gRPC's transport text with the stage's address; the field and retry hint kept."""

from __future__ import annotations

import logging
import re

import grpc
import pytest

from services.common import errors, rich_status
from services.gateway.routing import EnginePair
from services.gateway.stage_errors import stage_error

ADDRESS = re.compile(r"127\.0\.0\.1|unix:|\.sock|10\.0\.0\.8|:\d{2,5}\b")
TRANSPORT = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50053: "
             "Connection refused")


def _status(code: grpc.StatusCode, details: str, ours: bool = False, **extra) -> grpc.aio.AioRpcError:
    trailers = rich_status.trailers(code.name, details, **extra) if ours else ()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=details)


def _pair(name: str = "pair-0") -> EnginePair:
    return EnginePair(name, "unix:/tmp/vx/talker.sock", "127.0.0.1:50053", "talker-0", "c2w-0")


@pytest.mark.parametrize(("code", "kind", "words"), [
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable, "is unavailable"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded, "did not answer in time"),
    (grpc.StatusCode.INTERNAL, errors.Internal, "failed"),
    (grpc.StatusCode.UNKNOWN, errors.Internal, "failed")])
def test_the_transports_text_stays_in_the_log(code, kind, words, caplog):
    caplog.set_level(logging.INFO, "services.gateway.stage_errors")
    error = stage_error(_status(code, TRANSPORT), "code2wav", _pair())
    assert type(error) is kind and error.message == f"Code2Wav {words} (engine pair pair-0)"
    assert not ADDRESS.search(error.message)
    assert "127.0.0.1:50053: Connection refused" in caplog.text  # for the operator


def test_a_stages_own_message_follows():
    lost = _status(grpc.StatusCode.UNAVAILABLE, "talker t-0 lost", ours=True)
    error = stage_error(lost, "code2wav", _pair())
    assert error.message == "Code2Wav is unavailable (engine pair pair-0): talker t-0 lost"
    assert error.error_code == "unavailable"


def test_a_discovered_pairs_address_is_not_named():
    error = stage_error(_status(grpc.StatusCode.UNAVAILABLE, TRANSPORT), "talker", _pair("pair-10.0.0.8"))
    assert error.message == "the talker is unavailable (a discovered engine pair)"


def test_the_field_and_the_retry_hint_are_kept():
    bad = stage_error(_status(grpc.StatusCode.INVALID_ARGUMENT, "seed: too big", ours=True, field="seed"),
                      "talker", _pair())
    assert isinstance(bad, errors.InvalidArgument) and (bad.field, bad.reason) == ("seed", "too big")
    full = stage_error(_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "talker at capacity", ours=True,
                               retry_after=0.5), "talker", _pair())
    assert isinstance(full, errors.ResourceExhausted) and full.retry_after == 0.5
    assert full.message == "the talker is at capacity (engine pair pair-0): talker at capacity"
    assert full.error_code == "rate_limit_exceeded"
