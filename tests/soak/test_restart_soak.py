"""Bounded restart loop: each stage is started, used and stopped with SIGTERM many
times, with requests in flight while it drains; every exit must be 0 and nothing may
be left behind (socket, ready file, process)."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest

from tests.conftest import StageGroup, unix_config
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc

CYCLES = 25


@pytest.mark.soak
def test_gateway_restart_loop_with_requests_in_flight(sock_dir):
    config = unix_config(sock_dir, "gateway")
    for cycle in range(CYCLES):
        stages = StageGroup(sock_dir)
        try:
            gateway = stages.start("gateway", config)
            address = gateway.address
            codes: list[grpc.StatusCode] = []
            answered = threading.Event()

            def hammer(address=address, codes=codes, answered=answered):
                with grpc.insecure_channel(address) as channel:
                    stub = synthesizer_pb2_grpc.SynthesizerStub(channel)
                    for i in range(200):  # bounded
                        try:
                            stub.Synthesize(pb.SynthesizeSpeechRequest(text="" if i % 2 else "hi"),
                                            timeout=2)
                        except grpc.RpcError as exc:
                            answered.set()
                            codes.append(exc.code())
                            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                                return

            worker = threading.Thread(target=hammer)
            worker.start()
            assert answered.wait(timeout=10)  # requests are flowing when SIGTERM lands
            gateway.send_signal(signal.SIGTERM)
            assert gateway.proc.wait(timeout=15) == 0, f"cycle {cycle}: exit {gateway.proc.returncode}"
            worker.join(timeout=30)
            assert not worker.is_alive()
            assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.UNAVAILABLE}, codes
            assert not (sock_dir / "gateway.ready").exists()
        finally:
            stages.close(timeout=5)
