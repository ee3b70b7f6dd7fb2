"""``voxring.v1.Talker``: protobuf in, commands to the engine thread, protobuf out.

Validation that needs no engine state happens here, on the event loop; everything else
(admission, the attached consumers) is decided on the engine thread. Errors are domain
errors; the server interceptor maps them to status codes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from models.family import PromptSegment
from services.common.config import ConfigValueError
from services.common.engine_thread import EngineStopped, EngineThread
from services.common.errors import InvalidArgument, Unavailable
from services.common.limits import check_first_audio_budget
from services.common.sampling import Sampling
from services.talker.config import TalkerConfig
from services.talker.consumers import attach_response
from services.talker.core import overloaded
from services.talker.request import TalkerRequest
from services.talker.sessions import Segment, Session
from voxring.v1 import talker_pb2, talker_pb2_grpc


@dataclass(frozen=True)
class ModelFacts:
    """What the engine's model allows; the limits Submit is checked against."""

    num_codebooks: int
    codebook_size: int
    text_vocab_size: int
    max_len: int
    max_repetition_window: int
    # the family's pack_prompt (host code): Submit packs the prompt here, off the engine thread
    pack_prompt: Callable[[Sequence[PromptSegment]], np.ndarray]
    # the family's pack_slot_state (host code, like pack_prompt): what the request carries beyond
    # its prompt, written into its slot with the prompt's final chunk (None: the family keeps none)
    pack_slot_state: Callable[[Sequence[PromptSegment]], np.ndarray | None] = lambda segments: None
    family: str = "csm"
    audio_context: bool = True  # earlier turns carry their frames (TalkerModel.audio_context)


def _segments(req: talker_pb2.SubmitRequest, facts: ModelFacts) -> list[PromptSegment]:
    """The prompt's turns, checked (CSM: text tokens, then an audio turn's frames)."""
    if not req.segments:
        raise InvalidArgument("segments", "the prompt needs at least one segment")
    segments = []
    for i, seg in enumerate(req.segments):
        ids = _text_ids(seg.text_token_ids, facts, f"segments[{i}].text_token_ids")
        frames = None
        if seg.HasField("frames") and seg.frames.num_frames:
            frames = _frames(seg.frames, facts, f"segments[{i}].frames")
        segments.append(PromptSegment(ids, frames))
    return segments


def _text_ids(ids, facts: ModelFacts, field: str) -> list[int]:
    ids = list(ids)
    if any(t >= facts.text_vocab_size for t in ids):
        raise InvalidArgument(field, f"ids must be < {facts.text_vocab_size}")
    return ids


def _pack(segments: list[PromptSegment], facts: ModelFacts) -> tuple[np.ndarray, np.ndarray | None]:
    """The prompt packed by the family (``pack_prompt``: [L, N + 1] int64, one row per KV
    position; CSM: text tokens, then an audio turn's frames + 1 end frame) and its slot state
    (``pack_slot_state``). A layout the family refuses (its ValueError, ``field: reason``) is
    INVALID_ARGUMENT naming the field."""
    try:
        packed, state = facts.pack_prompt(segments), facts.pack_slot_state(segments)
    except ValueError as exc:
        field, _, reason = str(exc).partition(": ")
        if not reason or not field.startswith("segments"):
            field, reason = "segments", str(exc)
        raise InvalidArgument(field, reason) from None
    if len(packed) == 0:
        raise InvalidArgument("segments", "the prompt is empty")
    return packed, state


def _frames(frames: talker_pb2.Frames, facts: ModelFacts, field: str) -> torch.Tensor:
    if frames.num_codebooks != facts.num_codebooks:
        raise InvalidArgument(f"{field}.num_codebooks", f"must be {facts.num_codebooks}")
    expected = frames.num_frames * frames.num_codebooks * 2
    if len(frames.codes) != expected:
        raise InvalidArgument(f"{field}.codes", f"{len(frames.codes)} bytes; {expected} expected "
                              "(int16 [num_frames, num_codebooks])")
    codes = np.frombuffer(frames.codes, dtype="<i2").reshape(frames.num_frames, frames.num_codebooks)
    if codes.min() < 0 or codes.max() >= facts.codebook_size:
        raise InvalidArgument(f"{field}.codes", f"codes must be in [0, {facts.codebook_size})")
    return torch.from_numpy(codes.astype(np.int64))


def _check_budget(seconds: float) -> None:
    try:
        check_first_audio_budget(seconds)
    except ConfigValueError as exc:
        raise InvalidArgument(exc.key, exc.reason) from None


def build_request(req: talker_pb2.SubmitRequest, facts: ModelFacts, now: float,
                  first_audio_budget_s: float = 0.0) -> TalkerRequest:
    """``first_audio_budget_s``: the budget of a Submit that carries none (0: none)."""
    if not req.consumer_id:
        raise InvalidArgument("consumer_id", "must not be empty")
    if req.max_frames < 1:
        raise InvalidArgument("max_frames", f"must be >= 1, got {req.max_frames}")
    if req.min_frames > req.max_frames:
        raise InvalidArgument("min_frames", "must not exceed max_frames")
    if not req.timeout_s >= 0:
        raise InvalidArgument("timeout_s", f"must be >= 0, got {req.timeout_s}")
    _check_budget(req.first_audio_budget_s)
    segments = _segments(req, facts)
    prompt, slot_state = _pack(segments, facts)
    prompt_len = len(prompt)
    if prompt_len + req.max_frames > facts.max_len:
        raise InvalidArgument("max_frames", f"prompt ({prompt_len}) + max_frames ({req.max_frames}) "
                              f"exceeds the model's max length {facts.max_len}")
    s = req.sampling
    if s.repetition_window > facts.max_repetition_window:
        raise InvalidArgument("sampling.repetition_window",
                              f"must be <= {facts.max_repetition_window}, got {s.repetition_window}")
    try:
        sampling = Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                            repetition_penalty=s.repetition_penalty or 1.0,
                            repetition_window=s.repetition_window, seed=s.seed)
    except ConfigValueError as exc:
        raise InvalidArgument(f"sampling.{exc.key}", exc.reason) from None
    budget = req.first_audio_budget_s or first_audio_budget_s
    session = None
    if req.session:
        session = Session(facts.pack_prompt, facts.num_codebooks, voice=segments[:-1],
                          text_ids=np.asarray(segments[-1].text_token_ids, dtype=np.int64),
                          prefill_positions=prompt_len, pack_state=facts.pack_slot_state,
                          audio_context=facts.audio_context)
    return TalkerRequest(
        request_id=req.request_id or f"handle-{req.handle}", handle=req.handle,
        consumer_id=req.consumer_id, prompt=prompt, prompt_len=prompt_len, slot_state=slot_state,
        max_frames=req.max_frames, min_frames=req.min_frames, sampling=sampling,
        arrival=now, deadline=now + req.timeout_s if req.timeout_s else None,
        first_audio_by=now + budget if budget else None, session=session)


def build_segment(req: talker_pb2.AppendRequest, facts: ModelFacts, now: float,
                  first_audio_budget_s: float = 0.0) -> Segment:
    """A session's next segment from an Append (checked as a Submit's last segment is)."""
    if not req.consumer_id:
        raise InvalidArgument("consumer_id", "must not be empty")
    ids = _text_ids(req.text_token_ids, facts, "text_token_ids")
    if not ids:
        if req.last:  # the session ends after the segments queued before this
            return Segment(np.zeros(0, dtype=np.int64), 0, 0, True, 0.0, now)
        raise InvalidArgument("text_token_ids", "the segment's text is empty (only a last one may be: "
                              "it ends the session)")
    if req.max_frames < 1:
        raise InvalidArgument("max_frames", f"must be >= 1, got {req.max_frames}")
    if req.min_frames > req.max_frames:
        raise InvalidArgument("min_frames", "must not exceed max_frames")
    if 1 + len(ids) + req.max_frames > facts.max_len:  # its end frame, its text, its frames
        raise InvalidArgument("max_frames", f"the text ({len(ids)} tokens) + max_frames ({req.max_frames}) "
                              f"exceeds the model's max length {facts.max_len}")
    _check_budget(req.first_audio_budget_s)
    return Segment(np.asarray(ids, dtype=np.int64), req.max_frames, req.min_frames, req.last,
                   req.first_audio_budget_s or first_audio_budget_s, now)


class TalkerServicer(talker_pb2_grpc.TalkerServicer):
    def __init__(self, thread: EngineThread, config: TalkerConfig, facts: ModelFacts,
                 model_info: talker_pb2.ModelInfoResponse) -> None:
        self._thread = thread
        self._liveness_timeout = config.transport.liveness_timeout
        self._facts = facts
        self._model_info = model_info
        self._first_audio_budget_s = config.engine.first_audio_budget_s

    async def _call(self, command):
        """``command(engine)`` on the engine thread (see EngineThread.call)."""
        try:
            return await self._thread.call(command)
        except EngineStopped:
            raise Unavailable("talker engine is not running") from None

    async def Attach(self, request, context):
        if not request.consumer_id:
            raise InvalidArgument("consumer_id", "must not be empty")
        endpoint = await self._call(lambda core: core.attach(request.consumer_id,
                                                             request.consumer_instance_token))
        return attach_response(endpoint, self._liveness_timeout)

    async def ModelInfo(self, request, context):
        return self._model_info

    async def Submit(self, request, context):
        talker_request = build_request(request, self._facts, time.monotonic(),
                                       self._first_audio_budget_s)
        core = self._thread.engine
        refusing, checked = core.admission.claim()  # on the engine thread's verdict after its last step
        if refusing is not None:
            core.refused_early += 1
            raise overloaded(refusing)  # at once: the engine thread would answer only after its step
        position = await self._call(lambda core: core.submit(talker_request, checked=checked))
        admission = (talker_pb2.SubmitResponse.ADMISSION_ADMITTED if position == 0
                     else talker_pb2.SubmitResponse.ADMISSION_QUEUED)
        return talker_pb2.SubmitResponse(admission=admission, queue_position=position)

    async def WatchAdmission(self, request, context):
        async for verdict in self._thread.engine.verdicts.watch():
            yield verdict

    async def Cancel(self, request, context):
        found = await self._call(lambda core: core.cancel(request.consumer_id, request.handle))
        return talker_pb2.CancelResponse(found=found)

    async def Append(self, request, context):
        segment = build_segment(request, self._facts, time.monotonic(), self._first_audio_budget_s)
        queued = await self._call(lambda core: core.append(request.consumer_id, request.handle, segment))
        return talker_pb2.AppendResponse(queued=queued)

    async def Clear(self, request, context):
        found, dropped = await self._call(lambda core: core.clear(request.consumer_id, request.handle))
        return talker_pb2.ClearResponse(found=found, dropped=dropped)

    async def Stats(self, request, context):
        snap = await self._call(lambda core: core.stats())
        return talker_pb2.TalkerStats(
            running=snap.running, waiting=snap.waiting, free_slots=snap.free_slots,
            paused_rows=snap.paused_rows, steps_per_s=snap.steps_per_s, frames_per_s=snap.frames_per_s,
            mean_frames_per_step=snap.mean_frames_per_step, model_name=self._model_info.model_name)
