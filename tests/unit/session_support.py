"""Building blocks of the talker session tests: an engine on the tiny model (CPU) with session
slots, session requests and segments, and the ring records read back per segment."""

from __future__ import annotations

import numpy as np

from models.csm.model import pack_prompt
from models.family import PromptSegment
from models.tiny.talker import NUM_CODEBOOKS, build_tokenizer
from services.talker.engine import TalkerEngine
from services.talker.request import TalkerRequest
from services.talker.runner import Runner
from services.talker.scheduler import Scheduler
from services.talker.sessions import Segment, Session
from services.transport.layout import RecordFlags
from tests.unit.test_talker_engine import ListSink, frozen_clock


def text_ids(text: str, speaker: int = 0) -> list[int]:
    return build_tokenizer().encode(f"[{speaker}]{text}").ids


def make_session_engine(model, *, max_len: int = 256, rows: int = 4, sessions: int = 2, k_max: int = 4,
                        idle_s: float = 30.0, clock=frozen_clock, **runner_args):
    """``runner_args``: more of the Runner's (CUDA graphs, prefill buckets)."""
    slots = rows + sessions
    runner = Runner(model, num_slots=slots, max_len=max_len, buckets=[rows], k_max=k_max,
                    max_repetition_window=8, **runner_args)
    scheduler = Scheduler(num_slots=slots, max_num_seqs=rows, k_max=k_max, prefill_token_budget=4096,
                          max_waiting=16, stall_timeout=5.0, frame_rate=12.5, path_s=0.1,
                          bucket_for=runner.bucket_for, max_len=max_len, max_sessions=sessions,
                          session_idle_s=idle_s)
    sink = ListSink()
    return TalkerEngine(runner, scheduler, lambda consumer: sink, clock=clock), sink


def session_request(handle: int, ids: list[int], *, max_frames: int, voice: list[PromptSegment] = (),
                    min_frames: int = 0) -> TalkerRequest:
    """A session's Submit: its first segment is ``ids`` after the voice's context turns."""
    pack = lambda segments: pack_prompt(segments, NUM_CODEBOOKS, 0)  # noqa: E731
    segments = [*voice, PromptSegment(ids)]
    packed = pack(segments)
    session = Session(pack, NUM_CODEBOOKS, voice=list(voice), text_ids=np.asarray(ids, dtype=np.int64),
                      prefill_positions=len(packed))
    return TalkerRequest(request_id=f"s{handle}", handle=handle, consumer_id="c", prompt=packed,
                         prompt_len=len(packed), max_frames=max_frames, min_frames=min_frames,
                         session=session)


def plain_request(handle: int, segments: list[PromptSegment], *, max_frames: int) -> TalkerRequest:
    """A request (not a session) whose prompt is ``segments``: context turns, then the text."""
    packed = pack_prompt(segments, NUM_CODEBOOKS, 0)
    return TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id="c", prompt=packed,
                         prompt_len=len(packed), max_frames=max_frames)


def segment(ids: list[int], *, max_frames: int, last: bool = False, min_frames: int = 0) -> Segment:
    return Segment(np.asarray(ids, dtype=np.int64), max_frames, min_frames, last)


def run_until(engine, done, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if done():
            return
        engine.step()
    raise AssertionError("the engine did not get there")


def records_of(sink, handle: int) -> list[dict]:
    records = [r for r in sink.records if r["handle"] == handle]
    assert [r["seq"] for r in records] == list(range(len(records)))  # in order, no gap
    return records


def segments_of(sink, handle: int) -> list[tuple[np.ndarray, int, int]]:
    """Per segment: (its frames, the flag that ended it, its finish reason), in order."""
    out, frames, first = [], [], 0
    for r in records_of(sink, handle):
        assert r["first_frame"] == first
        if r["codes"] is not None:
            frames.append(r["codes"])
            first += len(r["codes"])
        ended = r["flags"] & int(RecordFlags.SEGMENT_END | RecordFlags.LAST | RecordFlags.CANCELLED)
        if ended:
            codes = np.concatenate(frames) if frames else np.zeros((0, NUM_CODEBOOKS), np.int16)
            out.append((codes, ended, r["finish"]))
            frames = []
    return out
