"""A scripted talker for Code2Wav tests, run as its own process.

It serves ``voxring.v1.Talker`` Attach (creating a real ring, mode 0600) and Cancel on
``--listen``, stores producer heartbeats, and writes the ring records the test sends as
JSON lines on its stdin::

    {"put": {"handle": 1, "seq": 0, "first_frame": 0, "codes": [[...], ...] | null,
             "flags": 0, "finish": 0}}

It reports on stdout, one JSON line each: {"ready": address}, {"attached": consumer_id,
"generation": n}, {"cancel": handle}, {"put_ok": handle, "seq": seq}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import sys
import threading

import grpc
import numpy as np

from services.talker.consumers import attach_response
from services.transport import TransportSection, open_producer
from voxring.v1 import talker_pb2, talker_pb2_grpc

_SAY = threading.Lock()


def say(**message) -> None:
    """One JSON line to the test; the servicer's threads write whole lines (print writes the text
    and its newline apart, and two threads' lines could run together)."""
    with _SAY:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


class FakeTalker(talker_pb2_grpc.TalkerServicer):
    def __init__(self, transport: TransportSection) -> None:
        self.transport = transport
        self.token = secrets.randbits(64)
        self.producer = None
        self.lock = threading.Lock()
        self.generation = 0

    async def Attach(self, request, context):
        with self.lock:
            if self.producer is not None:
                self.producer.close()
            self.generation += 1
            self.producer, endpoint = open_producer(self.transport, talker_instance_token=self.token,
                                                    consumer_id=request.consumer_id,
                                                    generation=self.generation)
        say(attached=request.consumer_id, generation=self.generation)
        return attach_response(endpoint, self.transport.liveness_timeout)

    async def Cancel(self, request, context):
        say(cancel=request.handle)
        return talker_pb2.CancelResponse(found=True)

    def put(self, spec: dict) -> None:
        codes = None if spec.get("codes") is None else np.asarray(spec["codes"], dtype=np.int16)
        with self.lock:
            self.producer.put(codes, handle=spec["handle"], seq=spec["seq"],
                              first_frame=spec.get("first_frame", 0), flags=spec.get("flags", 0),
                              finish_reason=spec.get("finish", 0), timeout=10.0)
        say(put_ok=spec["handle"], seq=spec["seq"])

    def heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.transport.heartbeat_interval / 2):
            with self.lock:
                if self.producer is not None:
                    self.producer.tick()


def read_commands(talker: FakeTalker) -> None:
    for line in sys.stdin:
        if line.strip():
            talker.put(json.loads(line)["put"])


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--liveness-timeout", type=float, default=0.4)
    parser.add_argument("--capacity", type=int, default=1 << 20)
    args = parser.parse_args()
    transport = TransportSection(capacity_bytes=args.capacity, liveness_timeout=args.liveness_timeout,
                                 heartbeat_interval=0.05)
    talker = FakeTalker(transport)
    server = grpc.aio.server()
    talker_pb2_grpc.add_TalkerServicer_to_server(talker, server)
    server.add_insecure_port(args.listen)
    await server.start()
    stop = threading.Event()
    threading.Thread(target=talker.heartbeat, args=(stop,), daemon=True).start()
    threading.Thread(target=read_commands, args=(talker,), daemon=True).start()
    terminate = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate.set)
    say(ready=args.listen)
    try:
        await terminate.wait()
        await server.stop(0.5)
    finally:
        stop.set()
        with talker.lock:
            if talker.producer is not None:
                talker.producer.close()  # the owner unlinks its ring


if __name__ == "__main__":
    asyncio.run(main())
