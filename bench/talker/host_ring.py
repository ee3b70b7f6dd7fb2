"""The talker host benchmark's sink: a real shared-memory ring and a consumer process.

The ring is made by the transport's own ``open_producer`` (as services/talker/consumers.py
attaches a Code2Wav instance), so the engine's ``try_put`` is the production write. A
consumer started with the 'spawn' method (never a fork: the parent has imported torch, and
a talker process would have imported grpc) attaches with ``open_consumer`` and reads every
record until the ring closes, checking each request's records arrive in order (seq from 0,
first_frame continuing the previous record) and counting frames. It runs in its own
process, so the engine thread's CPU time holds the producer's side only.

The ring has the production size (TransportSection's 4 MiB) and its data area is touched
once before the consumer attaches (bytes nobody reads: the consumer reads only up to the
published head), so no write during the measured steps takes a first-touch page fault that
a long-running talker would not.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
from dataclasses import dataclass, field, replace

from services.transport import Endpoint, TransportSection, open_consumer, open_producer

CONSUMER_ID = "code2wav-0"
START_TIMEOUT_S = 60.0   # the spawned consumer imports numpy and the transport
FINISH_TIMEOUT_S = 60.0  # it reads what is left after the ring closes
BATCH = 512
MAX_ERRORS = 20


def bench_section(spin_us: int | None = None) -> TransportSection:
    """Production ring size and spin (unless ``spin_us``); a long liveness timeout, since the
    benchmark pauses between cases (the heartbeats still run: the engine side ticks between
    steps)."""
    section = TransportSection(kind="shm", liveness_timeout=30.0)
    return section if spin_us is None else replace(section, spin_us=spin_us)


@dataclass
class Tally:
    """What the consumer saw, per request handle."""

    records: int = 0
    frames: int = 0
    next_seq: dict[int, int] = field(default_factory=dict)
    next_frame: dict[int, int] = field(default_factory=dict)
    last_flags: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    verify_codes: bool = False
    sleeps: int = 0  # waits that blocked on the semaphore: the producer posts to end each

    def add(self, record, codes) -> None:
        handle = record.handle
        seq, frame = self.next_seq.get(handle, 0), self.next_frame.get(handle, 0)
        if record.seq != seq or record.first_frame != frame:
            self.error(f"handle {handle}: seq {record.seq} first_frame {record.first_frame}, "
                       f"expected {seq} / {frame}")
        if record.num_frames and record.num_codebooks != 32:
            self.error(f"handle {handle}: {record.num_codebooks} codebooks")
        if self.verify_codes and record.num_frames and not (codes.min() >= 0 and codes.max() < 2048):
            self.error(f"handle {handle} seq {record.seq}: codes out of range")
        self.next_seq[handle] = record.seq + 1
        self.next_frame[handle] = record.first_frame + record.num_frames
        self.last_flags[handle] = record.flags
        self.records += 1
        self.frames += record.num_frames

    def error(self, text: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(text)

    def summary(self) -> dict:
        return {"records": self.records, "frames": self.frames, "errors": self.errors,
                "records_by_handle": dict(self.next_seq), "frames_by_handle": dict(self.next_frame),
                "last_flags": dict(self.last_flags), "sleeps": self.sleeps}


def drain(section: TransportSection, endpoint: Endpoint, conn, ready, verify_codes: bool,
          cpu: int | None) -> None:
    """The consumer process: reads every record until the producer closes the ring, then
    sends its tally through ``conn``."""
    from services.transport.layout import RingClosed

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    tally = Tally(verify_codes=verify_codes)
    consumer = open_consumer(section, endpoint, secrets.randbits(64))
    _count_sleeps(consumer, tally)
    ready.set()
    try:
        while True:
            try:
                batch = consumer.get_batch(BATCH, timeout=0.05)
            except RingClosed:
                break
            for record, codes in batch:
                tally.add(record, codes)
            consumer.release()
            consumer.tick()
    except Exception as exc:  # reported to the parent, which fails the case
        tally.error(f"consumer stopped: {exc!r}")
    finally:
        consumer.close()
        conn.send(tally.summary())
        conn.close()


def _count_sleeps(consumer, tally: Tally) -> None:
    """Counts the consumer's blocking waits (its private ``_block``, shadowed on this one
    instance): how often the producer had a sleeping consumer to post."""
    block = consumer._block

    def counted(seconds: float) -> None:
        tally.sleeps += 1
        block(seconds)

    consumer._block = counted


class RingConsumerProcess:
    """One ring (``producer``, the engine's sink) and the process draining it. ``finish()``
    closes the ring and returns the consumer's tally; ``close()`` (or leaving the ``with``)
    always ends the process and unlinks the ring, within bounded waits."""

    def __init__(self, *, verify_codes: bool = False, cpu: int | None = None,
                 section: TransportSection | None = None) -> None:
        self.section = section or bench_section()
        self.producer, self.endpoint = open_producer(
            self.section, talker_instance_token=secrets.randbits(64), consumer_id=CONSUMER_ID,
            generation=1)
        self._proc = None
        try:
            self._prefault()
            ctx = multiprocessing.get_context("spawn")
            self._ready = ctx.Event()
            self._conn, child = ctx.Pipe(duplex=False)
            args = (self.section, self.endpoint, child, self._ready, verify_codes, cpu)
            self._proc = ctx.Process(target=drain, name="ring-consumer", daemon=True, args=args)
            self._proc.start()
            child.close()
            if not self._ready.wait(START_TIMEOUT_S):
                raise RuntimeError(f"the consumer process did not attach within {START_TIMEOUT_S} s")
        except BaseException:
            self.close()
            raise

    def _prefault(self) -> None:
        """Touches every page of the data area (unpublished bytes, never read)."""
        data = self.producer._map.data
        data[:] = bytes(len(data))

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def finish(self, timeout: float = FINISH_TIMEOUT_S) -> dict:
        """Closes the ring; the consumer reads what is left and reports."""
        self.producer.close()
        if not self._conn.poll(timeout):
            raise RuntimeError(f"the consumer sent no tally within {timeout} s")
        tally = self._conn.recv()
        self._conn.close()
        self._proc.join(timeout)
        return tally

    def close(self) -> None:
        self.producer.close()  # idempotent; unlinks the ring and its semaphore
        if self._proc is not None:
            self._proc.join(5.0)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5.0)

    def __enter__(self) -> RingConsumerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
