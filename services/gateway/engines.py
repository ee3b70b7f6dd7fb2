"""The engine pairs a gateway routes to, and what it knows of their model.

A pair is one talker and one Code2Wav on the same host; a request is served by exactly
one pair (PROTOCOL.md, Units). The gateway has no model folder: it reads
``Talker.ModelInfo`` from each pair (the tokenizer, prompt format, limits, rates) the
first time it needs the pair, and refuses pairs whose model differs from the first one
it learned. Routing picks the pair with the fewest requests in flight from this gateway.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from tokenizers import Tokenizer

from services.common.errors import Unavailable
from voxring.v1 import code2wav_pb2_grpc, talker_pb2, talker_pb2_grpc

log = logging.getLogger(__name__)
MODEL_INFO_TIMEOUT_S = 5.0


@dataclass
class ModelFacts:
    name: str
    tokenizer: Tokenizer
    prompt_format: str
    max_len: int
    num_codebooks: int
    frame_rate: float
    sample_rate: int

    def prompt_ids(self, speaker_id: int, text: str) -> list[int]:
        """The text turn as token ids: the format already holds the special tokens."""
        prompt = self.prompt_format.replace("{speaker}", str(speaker_id)).replace("{text}", text)
        return self.tokenizer.encode(prompt, add_special_tokens=False).ids


@dataclass(eq=False)
class EnginePair:
    name: str
    talker_address: str
    code2wav_address: str
    talker_id: str       # the id this pair's Code2Wav knows its talker by
    consumer_id: str     # the consumer id its Code2Wav attached with
    in_flight: int = 0
    facts: ModelFacts | None = None
    _stubs: dict = field(default_factory=dict)
    _channels: list[grpc.aio.Channel] = field(default_factory=list)

    def _stub(self, kind: str, address: str, factory):
        """Channels open on first use, inside the server's event loop."""
        if kind not in self._stubs:
            channel = grpc.aio.insecure_channel(address)
            self._channels.append(channel)
            self._stubs[kind] = factory(channel)
        return self._stubs[kind]

    @property
    def talker(self) -> talker_pb2_grpc.TalkerStub:
        return self._stub("talker", self.talker_address, talker_pb2_grpc.TalkerStub)

    @property
    def code2wav(self) -> code2wav_pb2_grpc.Code2WavStub:
        return self._stub("code2wav", self.code2wav_address, code2wav_pb2_grpc.Code2WavStub)

    async def model_facts(self) -> ModelFacts:
        if self.facts is None:
            try:
                info = await self.talker.ModelInfo(talker_pb2.ModelInfoRequest(),
                                                   timeout=MODEL_INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                raise Unavailable(f"engine pair {self.name}: talker unreachable "
                                  f"({exc.code().name})") from None
            self.facts = ModelFacts(info.model_name, Tokenizer.from_str(info.tokenizer_json.decode()),
                                    info.prompt_format, info.max_len, info.num_codebooks, info.frame_rate,
                                    info.sample_rate)
        return self.facts

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class Router:
    def __init__(self, pairs: list[EnginePair]) -> None:
        self.pairs = pairs
        self.model_name: str | None = None
        self._lock = asyncio.Lock()

    async def pick(self) -> EnginePair:
        """The least-loaded pair serving this gateway's model (learning facts as needed)."""
        errors = []
        for pair in sorted(self.pairs, key=lambda p: p.in_flight):
            try:
                facts = await pair.model_facts()
            except Unavailable as exc:
                errors.append(str(exc))
                continue
            async with self._lock:
                if self.model_name is None:
                    self.model_name = facts.name
                    log.info("serving model %s (first learned from %s)", facts.name, pair.name)
            if facts.name != self.model_name:
                errors.append(f"engine pair {pair.name} serves {facts.name}, not {self.model_name}")
                continue
            return pair
        raise Unavailable("no engine pair can take the request: " + "; ".join(errors))

    @property
    def in_flight(self) -> int:
        return sum(p.in_flight for p in self.pairs)

    async def close(self) -> None:
        for pair in self.pairs:
            await pair.close()
