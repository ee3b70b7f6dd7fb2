"""The Code2Wav engine's side of its talkers' edges, a mixin of :class:`services.code2wav.engine.
Code2WavEngine`: taking records off the rings (at the start of a step, or waiting on one while
idle, until the next need at most; between a tick's calls, a fresh stream's first record), a talker
lost (what it wrote is taken first), the heartbeats, and the decode tick reported back to the
talkers (docs/protocol.md, Pacing).
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


def _fresh(stream) -> bool:
    """Nothing sent, nothing pending, no segment end waiting: in no cut of the tick under way."""
    return not (stream.closed or stream.chunk_index or stream.pending_frames or stream.segment_ends)


class TalkerIntake:
    """The edges' half of the engine (it supplies links, ticks, streams, clock, max_records, _due,
    _touched, _kept, _on_record, _end and first_audio)."""

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
        self._report()

    def _report(self) -> None:
        """The tick and the first audio lately (docs/protocol.md, Pacing: the first chunks' p90
        from their Opens; 0 with too few lately), to every attached talker; also at each
        housekeeping tick, so an idle engine's first audio ages out of its window there too."""
        tick, first_audio = self.tick_s(), self.first_audio.lately(self.clock()) or 0.0
        for link in self.links.values():
            if link.connected:
                with contextlib.suppress(RingError):
                    link.consumer.report_tick(tick, first_audio)

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
        self._report()

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
        self._apply_kept()  # taken before what is left: ring order
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
        took = self._apply_kept()
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

    def _take_between_calls(self) -> list:
        """Between a tick's decode calls: the rings' records taken now. A record of a fresh stream
        (open, nothing sent or pending, no segment end waiting) is applied at once, so its first
        chunk can join the next call; every other one is kept (copied) and applied at the next
        step's start, in ring order, before the records taken then: a cancel, a clear or a last
        record never changes a stream whose cut is planned for the next call. Returns the fresh
        streams that got frames. A ring that fails is left to the next step's take."""
        fresh = {}
        for link in self.links.values():
            if not link.connected:
                continue
            try:
                views = link.consumer.get_batch(self.max_records, timeout=0.0)
            except RingError:
                continue
            for record, codes in views:
                stream = self.streams.get(record.handle)
                if stream is not None and stream.talker_id == link.talker_id and _fresh(stream):
                    self._on_record(link.talker_id, record, codes)
                    if stream.pending_frames and not stream.closed:
                        fresh[stream.handle] = stream
                else:
                    self._kept.append((link.talker_id, record, codes.copy()))
            if views:
                link.consumer.release()
        return list(fresh.values())

    def _apply_kept(self) -> bool:
        """The records :meth:`_take_between_calls` kept, in ring order; True when there were any."""
        if not self._kept:
            return False
        kept, self._kept = self._kept, []
        for talker_id, record, codes in kept:
            self._on_record(talker_id, record, codes)
        return True

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
