"""The gateway's event loop and the load generator's, on virtual time.

The gateway lane makes the real pipeline's choices for each request (admission against
``admission.max_in_flight``, an older tree's chunk schedule from the pair's load (``compat``),
``max_frames`` from ``max_audio_seconds``, the Open → Submit order) and relays
chunks; the client lane sends a tier's requests (the closed loop of the committed runs, or
a Poisson / burst schedule from ``voxring.loads``) and records what it receives in
``voxring.loadgen.RequestTrace``, so the report is ``loadgen.summarize``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from bench.sim.compat import gateway_schedule
from bench.sim.devices import FRAME_RATE, SAMPLES_PER_FRAME
from bench.sim.engines import Code2WavProcess, HostCosts, Peer, TalkerProcess
from bench.sim.kernel import Lane, Mailbox, Sim
from services.gateway.config import GatewayConfig
from services.gateway.pipeline import first_audio_budget
from voxring.loadgen import RequestTrace
from voxring.v1 import code2wav_pb2, common_pb2, talker_pb2

SAMPLE_RATE = int(FRAME_RATE * SAMPLES_PER_FRAME)


def prompt_ids(text: str, speaker: int = 0) -> list[int]:
    """The text turn's ids as the benchmark checkpoint's byte-level tokenizer makes them:
    ``<bos>[speaker]text<eos>``."""
    return [1, *f"[{speaker}]{text}".encode(), 2]


def _outcome(error: Exception) -> str:
    """What the load generator records for a stage's error: "rejected" for RESOURCE_EXHAUSTED
    (as ``voxring.loadgen`` does), else the status code's name."""
    code = getattr(error, "code", "INTERNAL")
    return "rejected" if code == "RESOURCE_EXHAUSTED" else code


@dataclass
class _Request:
    token: int
    ids: list[int]
    max_frames: int
    schedule: object  # an older gateway's chunk schedule (None: Code2Wav cuts on need)
    arrival: float
    handle: int = 0


class GatewayProcess:
    def __init__(self, sim: Sim, gil, config: GatewayConfig, host: HostCosts, talker: TalkerProcess,
                 code2wav: Code2WavProcess, talker_id: str, consumer_id: str) -> None:
        self.sim, self.config, self.host = sim, config, host
        self.talker, self.code2wav = talker, code2wav
        self.talker_id, self.consumer_id = talker_id, consumer_id
        self.box = Mailbox(sim, "gateway-loop")
        self.peer = Peer(self.box)
        self.pair = SimpleNamespace(in_flight=0)
        self.requests: dict[int, _Request] = {}
        self.client: Peer | None = None
        self.lane = sim.lane("gateway-loop", gil, self._loop)

    def _loop(self, lane: Lane) -> None:
        handlers = {"synthesize": self._synthesize, "opened": self._opened, "submitted": self._submitted,
                    "chunk": self._chunk, "finished": self._finished, "error": self._error}
        while True:
            lane.wait([self.box], None)
            for kind, *rest in lane.take(self.box):
                handlers[kind](lane, *rest)
                lane.maybe_switch()

    def _synthesize(self, lane: Lane, token: int, text: str, seconds: float) -> None:
        lane.spend(self.host.served_call())
        if self.pair.in_flight >= self.config.admission.max_in_flight:
            self.client.box.put(("ended", token, "rejected", 0), lane.now())
            return
        self.pair.in_flight += 1
        schedule = gateway_schedule(self, self.pair)
        max_frames = max(1, math.ceil(seconds * FRAME_RATE - 1e-4))
        request = _Request(token, prompt_ids(text), max_frames, schedule, lane.now())
        self.requests[token] = request
        open_request = code2wav_pb2.OpenRequest(request_id=f"sim-{token}", talker_id=self.talker_id,
                                                max_frames=max_frames)
        if schedule is not None:
            open_request.chunk_schedule.CopyFrom(schedule)
        lane.spend(self.host.unary_client_s)
        self.code2wav.loop_box.put(("open", open_request, token, self.peer), lane.now())

    def _opened(self, lane: Lane, token: int, result) -> None:
        lane.spend(self.host.recv(16))
        if isinstance(result, Exception):
            self._end(lane, token, _outcome(result))
            return
        request = self.requests[token]
        request.handle = result
        submit = talker_pb2.SubmitRequest(
            request_id=f"sim-{token}", handle=result, consumer_id=self.consumer_id,
            segments=[talker_pb2.PromptSegment(text_token_ids=request.ids)],
            sampling=common_pb2.SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.0,
                                               seed=token),
            max_frames=request.max_frames,
            first_audio_budget_s=first_audio_budget(self.config.admission.first_audio_budget_s,
                                                    request.arrival, lane.now()))
        if request.schedule is not None:
            submit.chunk_schedule.CopyFrom(request.schedule)
        lane.spend(self.host.unary_client_s)
        self.talker.loop_box.put(("submit", submit, token, self.peer), lane.now())

    def _submitted(self, lane: Lane, token: int, result) -> None:
        if isinstance(result, Exception):  # Code2Wav's stream is closed with it
            handle = self.requests[token].handle
            self.code2wav.inbox.put(lambda engine: engine.close(handle), lane.now())
            self._end(lane, token, _outcome(result))

    def _chunk(self, lane: Lane, token: int, chunk) -> None:
        size = len(chunk.pcm)
        lane.spend(self.host.recv(size) + self.host.send(size))  # PCM out: the encoder passes it through
        self.client.box.put(("chunk", token, chunk.sample_offset, size // 2), lane.now())

    def _finished(self, lane: Lane, token: int, finish) -> None:
        lane.spend(self.host.recv(64) + self.host.send(64))
        self._end(lane, token, "ok", finish.frames)

    def _error(self, lane: Lane, token: int, code: str, message: str) -> None:
        lane.spend(self.host.recv(64))
        self._end(lane, token, "rejected" if code == "RESOURCE_EXHAUSTED" else code)

    def _end(self, lane: Lane, token: int, outcome: str, frames: int = 0) -> None:
        if self.requests.pop(token, None) is not None:
            self.pair.in_flight -= 1
        self.client.box.put(("ended", token, outcome, frames), lane.now())


@dataclass(frozen=True)
class Send:
    at_s: float          # after the tier starts (closed loop: when a worker is free)
    text: str
    seconds: float


@dataclass
class ClientPlan:
    """A tier's requests: an open-loop schedule, or a closed loop of ``workers``."""

    sends: list[Send]
    workers: int | None = None   # closed loop: this many at a time, each next as one ends


@dataclass
class ClientProcess:
    sim: Sim
    gil: object
    host: HostCosts
    gateway: GatewayProcess
    plan: ClientPlan
    traces: list[RequestTrace] = field(default_factory=list)
    done: bool = False
    lane: Lane | None = None

    def __post_init__(self) -> None:
        self.box = Mailbox(self.sim, "client-loop")
        self.gateway.client = Peer(self.box)
        self._sent_at: dict[int, float] = {}
        self.lane = self.sim.lane("client", self.gil, self._loop)

    def _send(self, lane: Lane, start: float, send: Send) -> None:
        token = len(self.traces)
        lane.spend(self.host.unary_client_s)
        now = lane.now()
        self.traces.append(RequestTrace(requested_audio_seconds=send.seconds, sent_at_s=now - start))
        self._sent_at[token] = now
        self.gateway.box.put(("synthesize", token, send.text, send.seconds), now)

    def _loop(self, lane: Lane) -> None:
        start = lane.now()
        pending = list(self.plan.sends)
        closed = self.plan.workers is not None
        running = 0
        while pending or running:
            while pending and (running < self.plan.workers if closed
                               else start + pending[0].at_s <= lane.now()):
                self._send(lane, start, pending.pop(0))
                running += 1
            timeout = None if closed or not pending else max(0.0, start + pending[0].at_s - lane.now())
            lane.wait([self.box], timeout)
            for kind, token, *rest in lane.take(self.box):
                if kind == "chunk":
                    self._chunk(lane, token, *rest)
                else:
                    self._ended(lane, start, token, *rest)
                    running -= 1
        self.done = True
        lane.sleep_until(lane.now() + 3600.0)  # the run ends here; the scheduler stops it

    def _chunk(self, lane: Lane, token: int, sample_offset: int, samples: int) -> None:
        lane.spend(self.host.recv(2 * samples))
        self.traces[token].arrivals.append((lane.now() - self._sent_at[token],
                                            (sample_offset + samples) / SAMPLE_RATE))

    def _ended(self, lane: Lane, start: float, token: int, outcome: str, frames: int) -> None:
        trace = self.traces[token]
        trace.outcome = outcome
        trace.ended_at_s = lane.now() - start
        trace.audio_seconds = frames / FRAME_RATE if outcome == "ok" else (
            trace.arrivals[-1][1] if trace.arrivals else 0.0)
