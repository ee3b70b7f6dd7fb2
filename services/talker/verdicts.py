"""The talker's admission verdicts to its watchers (``Talker.WatchAdmission``, docs/protocol.md,
Admission): the engine thread publishes each verdict that differs from the last, after a step,
and every watch stream on the event loop gets the newest. A stream that fell behind skips to the
newest; nothing waits for a slow reader."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.common.errors import ResourceExhausted
from voxring.v1 import talker_pb2


class VerdictFeed:
    def __init__(self) -> None:
        self.latest = talker_pb2.AdmissionVerdict()  # admitting until the engine says otherwise
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: set[asyncio.Queue] = set()

    def publish(self, refusal: str, retry_after_s: float, *, room: int = 0,
                past_room: ResourceExhausted | None = None) -> None:
        """Any thread (the engine's): the verdict now (``refusal`` "": admitting; ``room``: the
        Submits taken on it before ``past_room`` refuses them, 0: no bound)."""
        verdict = talker_pb2.AdmissionVerdict(refusal=refusal, retry_after_s=retry_after_s, room=room)
        if room and past_room is not None:
            verdict.room_refusal = past_room.message
            verdict.room_retry_after_s = past_room.retry_after or 0.0
        self.latest = verdict
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the streams are gone
                loop.call_soon_threadsafe(self._fan_out, verdict)

    def _fan_out(self, verdict: talker_pb2.AdmissionVerdict) -> None:
        for queue in self._queues:
            if queue.full():
                queue.get_nowait()  # an unread older verdict is replaced by the newest
            queue.put_nowait(verdict)

    async def watch(self) -> AsyncIterator[talker_pb2.AdmissionVerdict]:
        """The current verdict, then every newer one, until the caller stops reading."""
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        queue.put_nowait(self.latest)
        self._queues.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._queues.discard(queue)
