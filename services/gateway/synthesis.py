"""The gateway's synthesis front: a request's text of one sentence goes down the pipeline's
single-request path (services/gateway/pipeline.py), a text of several is spoken as a session
(services/gateway/long_text.py). Above both, so neither imports the other's caller."""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.common.limits import new_seed
from services.gateway import long_text
from services.gateway.pipeline import SynthesisPipeline
from services.gateway.validation import ValidRequest
from voxring.v1 import synthesizer_pb2 as pb


class Synthesis(SynthesisPipeline):
    async def stream(self, request: ValidRequest) -> AsyncIterator[pb.SynthesizeSpeechResponse]:
        if long_text.segment_count(request.text, self.config) > 1:  # several sentences: a session
            msg = request.message
            seed = msg.seed if msg.HasField("seed") else new_seed()
            async for message in long_text.stream_segmented(self, request, seed):
                yield message
            return
        async for message in super().stream(request):
            yield message
