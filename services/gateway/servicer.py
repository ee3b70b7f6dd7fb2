"""``voxring.v1.Synthesizer``: protobuf in, validated domain request out, and back.

The servicer only translates and relays (docs/protocol.md, Threads): validation,
the in-flight id check, then the backend that drives the engine pair (a streaming session:
services/gateway/streaming.py, on the same backend); voices are added and removed by the
voice manager (which the HTTP API calls too). Errors are domain
errors; the server interceptor turns them into status codes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

from services.common.log import request_id_var
from services.gateway.config import GatewayConfig
from services.gateway.inflight import InFlightRequests
from services.gateway.streaming import StreamingSession
from services.gateway.streaming_config import first_message, session_settings
from services.gateway.validation import ValidRequest, validate
from services.gateway.voice_manager import VoiceManager
from services.gateway.voices import VoiceCatalog, VoiceEntry
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc


class SynthesisBackend(Protocol):
    """Turns a validated request into audio messages (the engine pair's work)."""

    def stream(self, request: ValidRequest) -> AsyncIterator[pb.SynthesizeSpeechResponse]: ...

    async def whole(self, request: ValidRequest) -> pb.SynthesizeSpeechResponse: ...


def voice_message(voice: VoiceEntry, aliases: list[str] | None = None) -> pb.Voice:
    """``aliases``: the other names that select the voice (VoiceCatalog.aliases_of)."""
    return pb.Voice(name=voice.name, speaker_id=voice.speaker_id, language_code=voice.language_code,
                    has_reference=voice.reference_audio is not None, description=voice.description,
                    removable=voice.removable, aliases=aliases or [], model=voice.model or "")


class SynthesizerServicer(synthesizer_pb2_grpc.SynthesizerServicer):
    """``voices``: the catalog validation reads; ``voice_manager``: adds and removes voices
    in it (None: a manager that refuses to add, for a server without a voice folder)."""

    def __init__(self, config: GatewayConfig, voices: VoiceCatalog,
                 backend: SynthesisBackend, voice_manager: VoiceManager | None = None) -> None:
        self._config = config
        self.voices = voices
        self._backend = backend
        self.voice_manager = voice_manager or VoiceManager(config, voices, None, None)
        self.in_flight = InFlightRequests()

    def _accept(self, request: pb.SynthesizeSpeechRequest, context) -> ValidRequest:
        remaining = context.time_remaining()  # None: the client set no deadline
        deadline = None if remaining is None else time.monotonic() + remaining
        valid = validate(request, self._config, self.voices, deadline)  # it reaches both stages
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

    async def StreamingSynthesize(self, request_iterator, context):
        requests = aiter(request_iterator)
        config = first_message(await anext(requests, None))
        remaining = context.time_remaining()
        settings = session_settings(config, self._config, self.voices,
                                    None if remaining is None else time.monotonic() + remaining)
        request_id_var.set(settings.valid.request_id)
        with self.in_flight.reserve(settings.valid.request_id):
            async for message in StreamingSession(self._backend, settings).run(requests):
                yield message

    async def ListVoices(self, request, context):
        voices = [voice_message(v, self.voice_manager.catalog.aliases_of(v.name))
                  for v in self.voice_manager.list()]
        return pb.ListVoicesResponse(voices=voices, default_voice=self.voice_manager.default)

    async def CreateVoice(self, request, context):
        voice = await self.voice_manager.create(
            request.name, request.audio, request.transcript, speaker_id=request.speaker_id,
            language_code=request.language_code, description=request.description)
        return voice_message(voice)

    async def DeleteVoice(self, request, context):
        self.voice_manager.delete(request.name)
        return pb.DeleteVoiceResponse()
