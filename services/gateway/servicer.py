"""``voxring.v1.Synthesizer``: protobuf in, validated domain request out, and back.

The servicer only translates and relays (PROTOCOL.md's threading rule): validation,
the in-flight id check, then the backend that drives the engine pair. Errors are
domain errors; the server interceptor turns them into status codes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

from services.common.log import request_id_var
from services.gateway.config import GatewayConfig
from services.gateway.inflight import InFlightRequests
from services.gateway.validation import ValidRequest, validate
from services.gateway.voices import VoiceCatalog
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc


class SynthesisBackend(Protocol):
    """Turns a validated request into audio messages (the engine pair's work)."""

    def stream(self, request: ValidRequest) -> AsyncIterator[pb.SynthesizeSpeechResponse]: ...

    async def whole(self, request: ValidRequest) -> pb.SynthesizeSpeechResponse: ...


class SynthesizerServicer(synthesizer_pb2_grpc.SynthesizerServicer):
    def __init__(self, config: GatewayConfig, voices: VoiceCatalog,
                 backend: SynthesisBackend) -> None:
        self._config = config
        self._voices = voices
        self._backend = backend
        self.in_flight = InFlightRequests()

    def _accept(self, request: pb.SynthesizeSpeechRequest, context) -> ValidRequest:
        remaining = context.time_remaining()  # None: the client set no deadline
        deadline = None if remaining is None else time.monotonic() + remaining
        valid = validate(request, self._config, self._voices, deadline)  # it reaches both stages
        request_id_var.set(valid.request_id)  # this RPC's task: tags its log lines
        return valid

    async def Synthesize(self, request, context):
        valid = self._accept(request, context)
        with self.in_flight.reserve(valid.request_id):
            return await self._backend.whole(valid)

    async def SynthesizeOnline(self, request, context):
        valid = self._accept(request, context)
        with self.in_flight.reserve(valid.request_id):
            async for message in self._backend.stream(valid):
                yield message

    async def ListVoices(self, request, context):
        voices = [
            pb.Voice(name=v.name, speaker_id=v.speaker_id, language_code=v.language_code,
                     has_reference=v.reference_audio is not None, description=v.description)
            for v in self._voices.voices.values()
        ]
        return pb.ListVoicesResponse(voices=voices, default_voice=self._voices.default)
