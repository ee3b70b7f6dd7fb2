"""The Code2Wav engine's side of its talkers' edges, a mixin of :class:`services.code2wav.engine.
Code2WavEngine`: taking records off the rings (at the start of a step, or waiting on one while
idle, until the next need at most), a talker lost (what it wrote is taken first), the heartbeats,
and the decode tick reported back to the talkers (docs/protocol.md, Pacing).
"""

from __future__ import annotations

import contextlib
import logging

from services.code2wav.talkers import TalkerLink
from services.transport.layout import RingError

log = logging.getLogger("services.code2wav.engine")
IDLE_WAIT_S = 0.005  # how long an idle step waits on a ring for the next record
# The decode tick reported to the talkers and read by the cut rule: its mean and this many mean
# deviations (a record that comes during a tick waits for it, then for its own: the longer ticks
# make the stalls)
TICK_SPREAD = 2.0


class TalkerIntake:
    """The edges' half of the engine (it supplies links, ticks, streams, clock, max_records, _due,
    _touched, _on_record and _end)."""

    def tick_s(self) -> float:
        """A decode tick lately (``TICK_SPREAD``): what the talkers' pacing reads as the part of a
        record's way to the listener that varies, and a cut's lead (``margin_floor``)."""
        return self.ticks.bound(TICK_SPREAD)

    def margin_floor(self) -> float:
        """The least audio a listener keeps when its next chunk is cut (docs/protocol.md, Pacing):
        a need that comes during a tick is seen when it ends and decoded by the next, so two
        ticks; the stream's ``decode_margin_s`` where that is more."""
        return 2 * self.tick_s()

    def _observe_tick(self, seconds: float) -> None:
        """A step that decoded took ``seconds``: reported to every attached talker (docs/protocol.md,
        Pacing: the talker counts it in a record's way to its listener)."""
        self.ticks.observe(seconds)
        tick = self.tick_s()
        for link in self.links.values():
            if link.connected:
                with contextlib.suppress(RingError):
                    link.consumer.report_tick(tick)

    def _wait_s(self) -> float:
        """How long an idle tick may block on a ring: until the next need, IDLE_WAIT_S at most."""
        if not self._due:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.0, self._due[0][0] - self.clock()))

    def tick(self) -> None:
        now = self.clock()
        for link in self.links.values():
            if link.connected:
                with contextlib.suppress(RingError):  # a closed ring is found dead just below
                    link.consumer.tick()
                if not link.alive():
                    self._talker_lost(link)
            link.ensure(now)

    def wake(self) -> None:
        """Any thread (the EngineThread's ``wake``, after a command is posted): ends the idle
        wait on a ring, so an Open or a close is taken at once, not when the wait (up to
        IDLE_WAIT_S) times out."""
        for link in list(self.links.values()):
            consumer = link.consumer
            if consumer is not None:
                consumer.wake()

    def keepalive(self) -> None:
        """The engine thread's keeper, during a long step (a large decode, a first-use
        compile): this side's heartbeats only (docs/protocol.md, Rings)."""
        for link in list(self.links.values()):
            link.keepalive()

    def _talker_lost(self, link: TalkerLink, *, ring_readable: bool = True) -> None:
        """The talker behind ``link`` is gone. What it wrote before it went is taken first (a
        draining talker exits right after its last records, which may still wait in the ring);
        a request whose LAST record arrived then completes from the frames it has, the others end
        UNAVAILABLE. ``ring_readable`` False: the ring itself failed, nothing more is read."""
        if ring_readable:
            self._take_what_is_left(link)
        ours = [s for s in self.streams.values() if s.talker_id == link.talker_id]
        lost = [s for s in ours if s.last_reason is None]
        log.warning("talker %s lost; ending %d open request(s) UNAVAILABLE, %d complete from what arrived",
                    link.talker_id, len(lost), len(ours) - len(lost))
        for stream in lost:
            self._end(stream, "error", "UNAVAILABLE", f"talker {link.talker_id} lost")
        self._touched.update(s.handle for s in ours if s.last_reason is not None)
        link.drop()

    def _take_what_is_left(self, link: TalkerLink) -> None:
        with contextlib.suppress(RingError):
            while link.consumer is not None:
                views = link.consumer.get_batch(self.max_records, timeout=0.0)
                if not views:
                    return
                for record, codes in views:
                    self._on_record(link.talker_id, record, codes)
                link.consumer.release()

    def _consume(self) -> bool:
        took = False
        for link in self.links.values():
            if not link.connected:
                continue
            try:
                views = link.consumer.get_batch(self.max_records, timeout=0.0)
                for record, codes in views:
                    self._on_record(link.talker_id, record, codes)
                if views:
                    link.consumer.release()
                    took = True
            except RingError as exc:
                log.warning("talker %s: %s", link.talker_id, exc)
                self._talker_lost(link, ring_readable=False)
        return took

    def _wait_for_records(self) -> bool:
        """Blocks briefly on one attached ring (round robin); False when none is attached."""
        connected = [link for link in self.links.values() if link.connected]
        if not connected:
            return False
        self._turn = (self._turn + 1) % len(connected)
        link = connected[self._turn]
        try:
            view = link.consumer.get(timeout=self._wait_s())
        except RingError:
            self._talker_lost(link)
            return True
        if view is not None:
            self._on_record(link.talker_id, *view)
            link.consumer.release()
        return True

    def close_links(self) -> None:
        for link in self.links.values():
            link.close()
