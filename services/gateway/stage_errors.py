"""A stage's error status as the domain error the gateway's client gets (docs/protocol.md, How a
request ends): which stage of which pair, its own message where it wrote one, a retry hint kept."""

from __future__ import annotations

import logging
import math

import grpc

from services.common import errors
from services.common.rich_status import error_info
from services.common.server import RETRY_AFTER_METADATA
from services.gateway.routing import EnginePair

STATUS_ERRORS = {grpc.StatusCode.UNAVAILABLE: errors.Unavailable, grpc.StatusCode.INTERNAL: errors.Internal,
                 grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
                 grpc.StatusCode.CANCELLED: errors.Cancelled,
                 grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted}
STAGE_NAMES = {"talker": "the talker", "code2wav": "Code2Wav"}
STAGE_STATES = {grpc.StatusCode.UNAVAILABLE: "is unavailable", grpc.StatusCode.DEADLINE_EXCEEDED:
                "did not answer in time", grpc.StatusCode.CANCELLED: "cancelled the request",
                grpc.StatusCode.RESOURCE_EXHAUSTED: "is at capacity"}  # others: "failed"

log = logging.getLogger(__name__)


def stage_message(stage: str, code: grpc.StatusCode, pair: EnginePair, details: str = "") -> str:
    """What the client reads: the stage, its state and the pair, then the stage's own words where
    given, e.g. "the talker is at capacity (engine pair pair-0): talker at capacity: ..."."""
    message = f"{STAGE_NAMES.get(stage, stage)} {STAGE_STATES.get(code, 'failed')} ({pair.label})"
    return f"{message}: {details}" if details else message


def stage_error(exc: grpc.aio.AioRpcError, stage: str, pair: EnginePair) -> errors.ServiceError:
    """A stage's status as the domain error the client gets (a field named, a retry hint kept),
    saying which stage (``talker`` or ``code2wav``) of which pair failed. The stage's own message
    follows when the stage wrote it (it carries voxring's ErrorInfo); gRPC's own text for a
    transport failure (a refused connection, naming the stage's address) goes only to the log."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, reason = details.partition(": ")
        return errors.InvalidArgument(field, reason)
    ours = error_info(exc.trailing_metadata()) is not None
    if not ours:  # a deadline or cancel is the client's more often than the stage's
        quiet = code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
        log.log(logging.INFO if quiet else logging.WARNING, "engine pair %s: %s answered %s: %s",
                pair.name, stage, code.name, details)
    message = stage_message(stage, code, pair, details if ours else "")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a stage at capacity: keep its retry hint
        hint = dict(exc.trailing_metadata() or ()).get(RETRY_AFTER_METADATA)
        return errors.ResourceExhausted(message, retry_after=_seconds(hint))
    return STATUS_ERRORS.get(code, errors.Internal)(message)


def _seconds(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value > 0 else None
