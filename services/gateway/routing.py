"""The engine pairs a gateway routes to, and what it knows of their model.

A pair is one talker and one Code2Wav on the same host; a request is served by exactly
one pair (docs/protocol.md, Units and identities). The gateway has no model folder: it reads
``Talker.ModelInfo`` from each pair (the tokenizer, prompt format, limits, rates, family,
named speakers) the first time it needs the pair. Pairs may serve different models (of one
family or two): a request goes to a pair serving its model (its voice's, the HTTP ``model``
it names, else the default model: ``engines.default_model``, or the first one learned).
Among those, routing picks the pair with the fewest requests in flight from this gateway;
a pair that could not be reached is tried last for a while (backing off up to
``MAX_DOWN_S``), so one dead pair does not fail requests that another pair can serve.
(The health probes of services.gateway.readiness decide the gateway's readiness, not
the routing: a request learns a pair is down at the cost of one refused call.)

The pairs come from the config (a static list) or from DNS discovery
(:mod:`services.gateway.discovery`), which calls :meth:`Router.update`: a pair that left
takes no new requests, finishes those in flight, and is closed once it has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2_grpc
from tokenizers import Tokenizer

from services.common.errors import Unavailable
from services.gateway.verdicts import AdmissionWatch
from voxring.v1 import code2wav_pb2_grpc, talker_pb2, talker_pb2_grpc

log = logging.getLogger(__name__)
MODEL_INFO_TIMEOUT_S = 5.0
MIN_DOWN_S, MAX_DOWN_S = 1.0, 30.0  # an unreachable pair is tried last for this long, doubling
REQUEST_DOWN_S = 2.0                # at most this long after a failed request (it fails over)
FIRST_DISCOVERY_WAIT_S = 2.0        # a request that arrives before the first DNS answer waits
# after a talker refused a request for capacity, new requests to its pair are refused by the gateway
# itself for its retry hint, at most this long (the talker renews its verdict every step)
REFUSAL_HOLD_S = 0.05
# gRPC's default reconnect backoff grows to 120 s while a stage is down; requests would
# keep failing fast that long after it is back. Redial a restarted stage within a second.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass
class ModelFacts:
    name: str
    tokenizer: Tokenizer
    prompt_format: str
    max_len: int
    num_codebooks: int
    frame_rate: float
    sample_rate: int
    family: str = "csm"  # the talker's model family (ModelInfoResponse.family; empty from an older talker)
    speakers: tuple[tuple[str, int], ...] = ()  # the model's named speakers (name, speaker_id)

    @property
    def takes_clips(self) -> bool:
        """Whether a voice can be made from a clip (Code2Wav.EncodeVoice): CSM's audio-context
        turns; a Qwen2.5-Omni model's voices are its checkpoint's speakers."""
        return self.family == "csm"

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
    retired: bool = False    # left discovery: no new requests; closed when in_flight is 0
    failures: int = 0        # ModelInfo failures in a row
    down_until: float = 0.0  # monotonic time until which the pair is tried last
    refusing_until: float = 0.0  # monotonic: its talker refused for capacity; held until then
    refusal: str = ""            # that refusal, as the client got it
    admission: AdmissionWatch | None = None  # its talker's verdicts, watched from its first ModelInfo
    ready: bool | None = None  # both stages answer their health (None: not probed yet)
    state: str = "not probed yet"  # what the last probe found (services.gateway.readiness)
    _stubs: dict = field(default_factory=dict)
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)  # by kind

    def _stub(self, kind: str, address: str, factory, options=()):
        """A channel per kind, opened on first use inside the server's event loop."""
        if kind not in self._stubs:
            self._channels[kind] = grpc.aio.insecure_channel(address, options=[*RECONNECT_OPTIONS, *options])
            self._stubs[kind] = factory(self._channels[kind])
        return self._stubs[kind]

    def reconnecting(self, stage: str) -> bool:
        """True while the requests' channel to ``talker`` or ``code2wav`` waits out its
        reconnect backoff (a call there fails at once); it is asked to connect meanwhile.
        False for a channel not opened yet (the first call connects it)."""
        channel = self._channels.get(stage)
        if channel is None:
            return False
        return channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def health(self, stage: str) -> health_pb2_grpc.HealthStub:
        """The standard health service of the pair's ``talker`` or ``code2wav``, on its own
        channel and connection (gRPC shares connections between channels to one target
        unless told not to): a probe that found a stage down must not leave the requests'
        connection in its reconnect backoff, where a call fails at once until it redials."""
        address = self.talker_address if stage == "talker" else self.code2wav_address
        return self._stub(f"{stage}-health", address, health_pb2_grpc.HealthStub,
                          [("grpc.use_local_subchannel_pool", 1)])

    @property
    def talker(self) -> talker_pb2_grpc.TalkerStub:
        return self._stub("talker", self.talker_address, talker_pb2_grpc.TalkerStub)

    @property
    def code2wav(self) -> code2wav_pb2_grpc.Code2WavStub:
        return self._stub("code2wav", self.code2wav_address, code2wav_pb2_grpc.Code2WavStub)

    @property
    def label(self) -> str:
        """The pair as its clients may read of it in an error: "engine pair pair-0"; a
        discovered pair's name holds its address (pair-10.0.0.8), which only the log shows."""
        try:
            ipaddress.ip_address(self.name.removeprefix("pair-"))
        except ValueError:
            return f"engine pair {self.name}"
        return "a discovered engine pair"

    def serves(self, model: str | None, default: str | None) -> bool:
        """Whether this pair may serve ``model`` (None: ``default``): unknown until it answered."""
        return self.facts is None or self.facts.name == (model or default)

    def mark_down(self, longest: float = MAX_DOWN_S) -> None:
        """The pair failed a ModelInfo call or a request: tried last for a while (1 s,
        doubling up to ``longest`` while it keeps failing). A request on a pair that is
        tried last fails over at the cost of one refused call, so the request path keeps
        ``longest`` short and a restarted pair gets traffic again within seconds; an
        unreachable pair's ModelInfo can wait out its timeout, so that path backs off longer."""
        self.failures += 1
        self.down_until = time.monotonic() + min(longest, MIN_DOWN_S * 2 ** (self.failures - 1))

    def mark_up(self) -> None:
        """The pair served: back in the normal order."""
        self.failures, self.down_until = 0, 0.0

    def hold_refusal(self, message: str, retry_after: float | None, now: float) -> None:
        """Its talker refused a request for capacity: new requests are refused here for the
        refusal's retry hint, at most ``REFUSAL_HOLD_S`` (tried last meanwhile where another pair
        serves). Past capacity most requests are refused; each one that reaches the talker costs
        an Open on Code2Wav and a Submit, and waits behind the gateway's and both stages' loops."""
        if retry_after is not None and retry_after > 0:
            self.refusing_until = now + min(retry_after, REFUSAL_HOLD_S)
            self.refusal = message

    def refused_for(self, now: float) -> float:
        """Seconds its held refusal still applies (0: none)."""
        return max(0.0, self.refusing_until - now)

    def talker_refusing(self, now: float) -> tuple[str, float] | None:
        """(the talker's refusal, its retry hint) while its watched verdict refuses a request."""
        return None if self.admission is None else self.admission.refusing(now)

    def submitting(self) -> None:
        """A Submit goes to its talker (counted against its verdict's room)."""
        if self.admission is not None:
            self.admission.submitted()

    async def model_facts(self) -> ModelFacts:
        if self.facts is None:
            try:
                info = await self.talker.ModelInfo(talker_pb2.ModelInfoRequest(),
                                                   timeout=MODEL_INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                self.mark_down()
                log.info("engine pair %s: the talker at %s answered ModelInfo %s: %s", self.name,
                         self.talker_address, exc.code().name, exc.details())
                raise Unavailable(f"the talker is unavailable ({self.label})") from None
            self.mark_up()
            if self.admission is None:  # from now on, for the pair's life
                self.admission = AdmissionWatch(self.talker, self.name)
                self.admission.start()
            self.facts = ModelFacts(info.model_name, Tokenizer.from_str(info.tokenizer_json.decode()),
                                    info.prompt_format, info.max_len, info.num_codebooks, info.frame_rate,
                                    info.sample_rate, info.family or "csm",
                                    tuple((sp.name, sp.speaker_id) for sp in info.speakers))
        return self.facts

    async def close(self) -> None:
        if self.admission is not None:
            await self.admission.close()
        channels, self._channels, self._stubs = self._channels, {}, {}
        for channel in channels.values():
            await channel.close()


class Router:
    """Routes each request to one pair. ``pairs`` take new requests; ``retired`` pairs
    (gone from discovery) only finish theirs. ``source`` is the DNS name the pairs are
    discovered from (None: a static list, known from the start)."""

    def __init__(self, pairs: list[EnginePair], source: str | None = None,
                 default_model: str | None = None,
                 on_model: Callable[[ModelFacts], None] | None = None) -> None:
        self.pairs = list(pairs)
        self.retired: list[EnginePair] = []
        self.source = source
        # the model a request naming none gets (engines.default_model; None: the first learned)
        self.default_model = default_model
        self.on_model = on_model  # told of each model when a pair first says it serves it
        self._models: set[str] = set()
        self.discovered = asyncio.Event()  # set by the first discovery answer (or at once: static)
        if source is None:
            self.discovered.set()
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task] = set()

    async def acquire(self, exclude: frozenset[str] = frozenset(), model: str | None = None) -> EnginePair:
        """A pair for one request (none named in ``exclude``) serving ``model`` (None: the
        default model), counted in flight until :meth:`release`."""
        pair = await self.pick(exclude, model)
        pair.in_flight += 1  # no await since pick() checked it is not retired
        return pair

    def release(self, pair: EnginePair) -> None:
        pair.in_flight -= 1
        if pair.retired and pair.in_flight == 0:
            self._close(pair)

    async def pick(self, exclude: frozenset[str] = frozenset(), model: str | None = None) -> EnginePair:
        """The least-loaded pair serving ``model`` (None: the default model), learning facts as
        needed; pairs that could not be reached lately are tried last, before them those whose
        talker refused a moment ago. Pairs may serve different models (families): each request
        goes to one that serves its voice's model."""
        await self._first_discovery()
        errors, serving = [], set()
        now = time.monotonic()
        order = sorted(self.pairs, key=lambda p: (p.down_until > now, p.refusing_until > now
                                                  or p.talker_refusing(now) is not None,
                                                  p.in_flight))
        async for pair, facts in self._answering([p for p in order if p.name not in exclude], errors):
            if facts.name != (model or self.default_model):
                serving.add(facts.name)
                continue
            if pair.retired:
                errors.append(f"{pair.label} left discovery")
                continue
            return pair
        if serving and not errors:
            raise Unavailable(f"no engine pair serves model {model or self.default_model} "
                              f"(served: {', '.join(sorted(serving))})")
        raise Unavailable("no engine pair can take the request: " + "; ".join(errors or ["none left to try"]))

    async def _first_discovery(self) -> None:
        if not self.pairs and not self.discovered.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_DISCOVERY_WAIT_S):
                    await self.discovered.wait()
        if not self.pairs:
            raise Unavailable("no engine pair discovered yet (DNS discovery)" if self.source
                              else "no engine pair configured")

    async def models(self) -> dict[str, ModelFacts]:
        """The models the pairs serve, by name, the default one first (each pair that answers
        its ModelInfo counts; Unavailable when none does)."""
        await self._first_discovery()
        served: dict[str, ModelFacts] = {}
        errors: list[str] = []
        async for _, facts in self._answering(self.pairs, errors):
            served.setdefault(facts.name, facts)
        if not served:
            raise Unavailable("no engine pair can take the request: " + "; ".join(errors))
        default = served.pop(self.default_model, None)
        return {self.default_model: default, **served} if default is not None else served

    async def _answering(self, pairs: list[EnginePair], errors: list[str]):
        """(pair, its model facts) for each of ``pairs`` not retired whose talker answers, in
        order; why each other one did not goes into ``errors``."""
        for pair in pairs:
            if pair.retired:  # left discovery meanwhile
                continue
            try:
                facts = await self.learn(pair)
            except Unavailable as exc:
                errors.append(str(exc))
                continue
            yield pair, facts

    async def learn(self, pair: EnginePair) -> ModelFacts:
        """``pair``'s model facts (asked once; Unavailable when its talker does not answer); the
        first model learned is the default unless the config names one, and ``on_model`` hears
        of each model once."""
        facts = await pair.model_facts()
        async with self._lock:
            if self.default_model is None:
                self.default_model = facts.name
                log.info("default model %s (first learned from %s)", facts.name, pair.name)
            new = facts.name not in self._models
            self._models.add(facts.name)
        if new:
            log.info("engine pair %s serves model %s (%s family)", pair.name, facts.name, facts.family)
            if self.on_model is not None:
                self.on_model(facts)
        return facts

    def update(self, pairs: list[EnginePair]) -> None:
        """Makes ``pairs`` the ones taking new requests. A pair is known by its name: one
        already routed to (or still retiring) is kept with its channels, facts and count;
        a pair not listed any more is retired. Call it inside the event loop."""
        self.discovered.set()
        known = {p.name: p for p in (*self.retired, *self.pairs)}
        wanted = [known.get(p.name, p) for p in pairs]
        wanted_names = {p.name for p in wanted}
        for pair in wanted:
            if pair.name not in known:
                log.info("engine pair %s added (talker %s, code2wav %s)", pair.name,
                         pair.talker_address, pair.code2wav_address)
            elif pair.retired:
                log.info("engine pair %s is back: taking requests again", pair.name)
                self.retired.remove(pair)
                pair.retired = False
        for pair in self.pairs:
            if pair.name not in wanted_names:
                log.info("engine pair %s retired: no new requests, %d still in flight", pair.name,
                         pair.in_flight)
                pair.retired = True
                if pair.in_flight:
                    self.retired.append(pair)
                else:
                    self._close(pair)
        self.pairs = wanted

    def _close(self, pair: EnginePair) -> None:
        with contextlib.suppress(ValueError):
            self.retired.remove(pair)
        task = asyncio.get_running_loop().create_task(pair.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @property
    def in_flight(self) -> int:
        return sum(p.in_flight for p in (*self.pairs, *self.retired))

    async def close(self) -> None:
        for pair in (*self.pairs, *self.retired):
            await pair.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
