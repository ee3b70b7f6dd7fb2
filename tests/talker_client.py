"""A Code2Wav stand-in for talker tests: attaches over gRPC and reads its ring on a
thread, storing heartbeats like a real consumer; it can stop reading (ring fills up
while it stays alive) or die (heartbeats stop)."""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np

from services.transport import Endpoint, TransportSection, open_consumer
from services.transport.layout import RingError
from voxring.v1 import common_pb2, talker_pb2, talker_pb2_grpc


class RingReader:
    def __init__(self, stub: talker_pb2_grpc.TalkerStub, consumer_id: str,
                 transport: TransportSection | None = None) -> None:
        self.consumer_id = consumer_id
        self.token = secrets.randbits(64)
        self.transport = transport or TransportSection()
        reply = stub.Attach(talker_pb2.AttachRequest(consumer_id=consumer_id,
                                                     consumer_instance_token=self.token), timeout=10)
        self.endpoint = Endpoint(reply.transport, consumer_id, reply.talker_instance_token,
                                 reply.generation, reply.capacity_bytes, reply.ring_name,
                                 reply.wakeup_semaphore, reply.address)
        self.consumer = open_consumer(self.transport, self.endpoint, self.token)
        self.records: dict[int, list] = {}
        self.reading = threading.Event()
        self.reading.set()
        self._alive = True
        self.ended: RingError | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._read()
        except RingError as exc:  # the producer closed or died: nothing more will come
            self.ended = exc

    def _read(self) -> None:
        while self._alive:
            self.consumer.tick()
            if not self.reading.is_set():
                time.sleep(0.02)
                continue
            view = self.consumer.get(timeout=0.02)
            if view is None:
                continue
            record, codes = view
            with self._lock:
                self.records.setdefault(record.handle, []).append((record, np.array(codes)))
            self.consumer.release()

    def die(self) -> None:
        """Stops reading and heartbeats, like a killed process."""
        self._alive = False
        self._thread.join(timeout=5)

    def close(self) -> None:
        self.die()
        self.consumer.close()

    def finished(self, handle: int) -> bool:
        with self._lock:
            recs = self.records.get(handle, [])
            return bool(recs) and (recs[-1][0].last or recs[-1][0].cancelled)

    def wait(self, handles, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.finished(h) for h in handles):
            if time.monotonic() > deadline:
                raise AssertionError(f"handles {handles} not finished in {timeout} s")
            time.sleep(0.01)

    def result(self, handle: int) -> tuple[np.ndarray, int, list]:
        """Frames in order (seq and first_frame checked) and the finish reason."""
        with self._lock:
            recs = list(self.records[handle])
        assert [r.seq for r, _ in recs] == list(range(len(recs)))
        frames, first = [], 0
        for record, codes in recs:
            assert record.first_frame == first
            if record.num_frames:
                frames.append(codes)
                first += record.num_frames
        codes = np.concatenate(frames) if frames else np.zeros((0, 0), np.int16)
        return codes, recs[-1][0].finish_reason, [r for r, _ in recs]


def submit_request(consumer_id: str, handle: int, token_ids: list[int], *, max_frames: int,
                   seed: int = 0, temperature: float = 0.0, top_k: int = 0,
                   timeout_s: float = 0.0) -> talker_pb2.SubmitRequest:
    return talker_pb2.SubmitRequest(
        request_id=f"req-{handle}", handle=handle, consumer_id=consumer_id,
        segments=[talker_pb2.PromptSegment(text_token_ids=token_ids)],
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=1.0,
                                           repetition_penalty=1.0, seed=seed),
        max_frames=max_frames, timeout_s=timeout_s)


def stats(stub: talker_pb2_grpc.TalkerStub) -> talker_pb2.TalkerStats:
    return stub.Stats(talker_pb2.TalkerStatsRequest(), timeout=10)


HANG_S = 60.0  # a bound against hangs, not a speed target: two suites on two cores are slow


def wait_for(predicate, timeout: float = HANG_S, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


__all__ = ["RingReader", "stats", "submit_request", "wait_for"]
