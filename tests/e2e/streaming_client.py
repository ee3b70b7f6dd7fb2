"""A StreamingSynthesize client for the end-to-end tests: sends a session's messages on the gRPC
request thread (pieces with waits between them, as a language model writes) and keeps every
response with its arrival time, and when each piece was sent."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from voxring.v1 import synthesizer_pb2 as pb


@dataclass
class Step:
    """One client message, sent ``wait_s`` after the one before (or after ``event`` is set)."""

    message: pb.StreamingSynthesizeRequest
    wait_s: float = 0.0
    event: threading.Event | None = None


def config(**fields) -> Step:
    return Step(pb.StreamingSynthesizeRequest(config=pb.StreamingConfig(**fields)))


def text(piece: str, wait_s: float = 0.0) -> Step:
    return Step(pb.StreamingSynthesizeRequest(text=piece), wait_s)


def flush(wait_s: float = 0.0) -> Step:
    return Step(pb.StreamingSynthesizeRequest(flush=pb.Flush()), wait_s)


def clear(event: threading.Event | None = None) -> Step:
    return Step(pb.StreamingSynthesizeRequest(clear=pb.Clear()), event=event)


def words(paragraph: str, every_s: float) -> list[Step]:
    """The paragraph a word at a time (each with its following space), ``every_s`` apart."""
    pieces = paragraph.split(" ")
    return [text(w + (" " if i < len(pieces) - 1 else ""), every_s) for i, w in enumerate(pieces)]


@dataclass
class Session:
    """The responses of one session, each with its arrival time; when each step was sent."""

    responses: list = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    started: float = 0.0

    def audio(self) -> list:
        return [r.audio for r in self.responses if r.WhichOneof("kind") == "audio"]

    def audio_times(self) -> list[tuple[float, object]]:
        return [(t, r.audio) for t, r in zip(self.times, self.responses, strict=True)
                if r.WhichOneof("kind") == "audio"]

    def segments_done(self) -> list:
        return [r.segment_done for r in self.responses if r.WhichOneof("kind") == "segment_done"]

    def done(self):
        finals = [r.done for r in self.responses if r.WhichOneof("kind") == "done"]
        return finals[-1] if finals else None


def run(stub, steps: list[Step], *, timeout: float = 120.0, session: Session | None = None) -> Session:
    """Sends ``steps`` in order and closes the request stream; ``session``: where the responses
    go as they come (another thread may watch it), else a new one."""
    session = session or Session()
    session.started = time.monotonic()

    def requests():
        for step in steps:
            if step.event is not None:
                step.event.wait(timeout)
            if step.wait_s:
                time.sleep(step.wait_s)
            session.sent_at.append(time.monotonic())
            yield step.message

    for response in stub.StreamingSynthesize(requests(), timeout=timeout):
        session.responses.append(response)
        session.times.append(time.monotonic())
    return session
