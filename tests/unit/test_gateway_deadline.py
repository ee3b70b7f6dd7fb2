"""The client's deadline travels on the validated request (not through ambient state):
the servicer stamps it once, the pipeline turns it into each stage call's timeout."""

from __future__ import annotations

import time

from services.gateway.config import GatewayConfig
from services.gateway.pipeline import _remaining
from services.gateway.servicer import SynthesizerServicer
from services.gateway.validation import validate
from services.gateway.voices import VoiceCatalog
from voxring.v1 import synthesizer_pb2 as pb


class _Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


def _accept(remaining: float | None):
    servicer = SynthesizerServicer(GatewayConfig(), VoiceCatalog.builtin(), backend=None)
    return servicer._accept(pb.SynthesizeSpeechRequest(text="Hello."), _Context(remaining))


def test_the_rpc_deadline_is_stamped_on_the_request():
    before = time.monotonic()
    valid = _accept(2.5)
    assert before + 2.5 <= valid.deadline <= time.monotonic() + 2.5
    assert 0 < _remaining(valid) <= 2.5


def test_no_deadline_is_none_on_every_stage_call():
    valid = _accept(None)
    assert valid.deadline is None and _remaining(valid) is None


def test_a_passed_deadline_still_gives_the_stages_a_positive_timeout():
    valid = validate(pb.SynthesizeSpeechRequest(text="Late."), GatewayConfig(), VoiceCatalog.builtin(),
                     deadline=time.monotonic() - 1.0)
    assert _remaining(valid) == 0.001  # the stage call fails DEADLINE_EXCEEDED at once, not never
