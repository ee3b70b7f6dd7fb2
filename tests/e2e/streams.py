"""Streams through the public API for the fault and load tests: one SynthesizeOnline
call read to its end (optionally cancelled), streams on their own threads, the checks a
completed stream must pass, and the requests the scenarios send."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from voxring.v1 import common_pb2
from voxring.v1 import synthesizer_pb2 as pb

SPF = 1920            # samples per frame of voxring-tiny at its own rate (24 kHz)
FRAME_RATE = 12.5     # frames per second of voxring-tiny
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright",
         "birds", "sing", "softly", "near", "an", "old", "stone", "bridge", "and", "river", "carries",
         "small", "boats", "toward", "quiet", "town")




@dataclass
class StreamResult:
    audio: list = field(default_factory=list)   # the audio messages, in order (the final excluded)
    final: pb.SynthesizeSpeechResponse | None = None
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    trailers: dict = field(default_factory=dict)
    started: float = 0.0
    first_audio: float | None = None
    ended: float = 0.0
    cancelled: bool = False     # the client cancelled it

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK and self.final is not None


def run_stream(stub, request: pb.SynthesizeSpeechRequest, *, cancel_after_chunks: int | None = None,
               cancel_after_s: float | None = None, timeout: float = 60.0,
               on_chunk: Callable[[StreamResult], None] | None = None) -> StreamResult:
    """One SynthesizeOnline call read to its end. ``cancel_after_s``: cancelled that long
    after sending, before anything is read; ``cancel_after_chunks``: cancelled once that
    many audio chunks arrived. Never raises for a status: it is in the result."""
    result = StreamResult(started=time.monotonic())
    call = stub.SynthesizeOnline(request, timeout=timeout)
    try:
        if cancel_after_s is not None:
            time.sleep(cancel_after_s)
            call.cancel()
            result.cancelled = True
        for message in call:
            if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                result.final = message
                continue
            if result.first_audio is None:
                result.first_audio = time.monotonic()
            result.audio.append(message)
            if on_chunk is not None:
                on_chunk(result)
            if cancel_after_chunks is not None and len(result.audio) >= cancel_after_chunks:
                call.cancel()
                result.cancelled = True
    except grpc.RpcError as exc:
        result.code, result.details = exc.code(), exc.details() or ""
        result.trailers = dict(exc.trailing_metadata() or ())
    result.ended = time.monotonic()
    return result


def frames_for(seconds: float) -> int:
    """The frames the gateway allows for ``max_audio_seconds`` (a float32 on the wire)."""
    return max(1, math.ceil(float(np.float32(seconds)) * FRAME_RATE - 1e-4))


def check_contiguous(result: StreamResult, max_frames: int | None = None) -> None:
    """A completed LINEAR_PCM stream at the model's rate: chunk indices 0, 1, 2, ... and
    each chunk's sample offset = the previous offset + the previous chunk's samples; the
    samples add up to the frames the usage reports (the limit, or fewer on STOP)."""
    assert result.ok, (result.code, result.details)
    indices = [m.chunk_index for m in result.audio]
    assert indices == list(range(len(indices))), f"chunk indices {indices}"
    expected = 0
    for message in result.audio:
        assert message.sample_offset == expected, \
            f"chunk {message.chunk_index}: offset {message.sample_offset}, expected {expected}"
        expected += len(message.audio) // 2
    frames = result.final.usage.frames
    assert expected + len(result.final.audio) // 2 == frames * SPF, (expected, frames)
    if max_frames is not None:
        assert frames == max_frames or (result.final.finish_reason == common_pb2.FINISH_REASON_STOP
                                         and 0 < frames < max_frames), (frames, max_frames)


def request(text: str, *, seconds: float | None = None, seed: int = 0, request_id: str = "") \
        -> pb.SynthesizeSpeechRequest:
    fields = {"text": text, "seed": seed, "request_id": request_id}
    if seconds is not None:
        fields["max_audio_seconds"] = seconds
    return pb.SynthesizeSpeechRequest(**fields)


class Streams:
    """Streams running on their own threads; ``join`` is bounded."""

    def __init__(self) -> None:
        self.results: dict[str, StreamResult] = {}
        self.errors: list[tuple[str, BaseException]] = []
        self._threads: list[threading.Thread] = []

    def start(self, key: str, fn: Callable[[], StreamResult]) -> None:
        def run():
            try:
                self.results[key] = fn()
            except BaseException as exc:  # reported by join
                self.errors.append((key, exc))

        thread = threading.Thread(target=run, name=f"stream-{key}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self, timeout: float = 120.0) -> dict[str, StreamResult]:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"streams still running after {timeout} s: {alive}"
        assert not self.errors, self.errors
        return self.results


def random_text(rng: random.Random, low: int = 1, high: int = 30) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high))).capitalize() + "."
