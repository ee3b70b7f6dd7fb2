"""A pair's talker's admission verdicts, watched by the gateway (``Talker.WatchAdmission``,
docs/protocol.md, Admission): while the talker's latest verdict is a refusal, or this gateway has
sent it as many Submits as that verdict has room for while its engine steps, a new request to the
pair is refused here at once, with the message and retry hint the talker's Submit would give,
without an Open on Code2Wav and a Submit (each a round trip through a busy stage's event loop:
the refusals past capacity that took 60-90 ms, bench notes run 15).

The watch is one server stream per pair, opened with the pair's first ModelInfo and read for as
long as the pair lives; when it fails or ends (the talker restarted or drains) the verdict is
unknown, every request asks the talker as before, and the watch is opened again after a backoff.
A refusal older than ``STALE_S`` is not trusted: a talker whose engine stopped stepping publishes
nothing new, and its last refusal must not refuse for it forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from voxring.v1 import talker_pb2

log = logging.getLogger(__name__)

STALE_S = 1.0                   # a refusal this old is asked again of the talker
RETRY_S, MAX_RETRY_S = 0.5, 5.0  # the watch reopened after a failure, doubling up to the most


class AdmissionWatch:
    def __init__(self, talker, name: str, clock=time.monotonic) -> None:
        self._talker = talker  # the pair's Talker stub
        self._name = name
        self._clock = clock
        self.verdict: talker_pb2.AdmissionVerdict | None = None  # None: unknown
        self.verdict_at = 0.0
        self.verdicts = 0  # received, over the watch's life
        self.sent = 0      # Submits sent since the latest verdict
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Opens the watch (inside the gateway's event loop); once."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def refusing(self, now: float) -> tuple[str, float] | None:
        """(the talker's refusal message, its retry hint) while its verdict is a fresh refusal, or
        while this gateway has sent it as many Submits as the verdict has room for."""
        verdict = self.verdict
        if verdict is None or now - self.verdict_at > STALE_S:
            return None
        if verdict.refusal:
            return verdict.refusal, verdict.retry_after_s
        if verdict.room and self.sent >= verdict.room:
            return verdict.room_refusal, verdict.room_retry_after_s
        return None

    def submitted(self) -> None:
        """A Submit sent to the talker on its current verdict (counted against its room)."""
        self.sent += 1

    async def _run(self) -> None:
        backoff = RETRY_S
        while True:
            try:
                async for verdict in self._talker.WatchAdmission(talker_pb2.WatchAdmissionRequest()):
                    self.verdict, self.verdict_at, self.sent = verdict, self._clock(), 0
                    self.verdicts += 1
                    backoff = RETRY_S
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a talker without it: ask it each time
                    log.info("engine pair %s: its talker has no WatchAdmission; each request asks it",
                             self._name)
                    self.verdict = None
                    return
                log.debug("engine pair %s: admission watch ended %s", self._name, exc.code().name)
            self.verdict = None
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_RETRY_S)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
