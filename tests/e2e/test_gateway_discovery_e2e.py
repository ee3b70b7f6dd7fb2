"""A gateway that finds its engine pair by DNS: talker and Code2Wav on free loopback TCP
ports, the gateway configured with ``engines.discovery.service: localhost`` and those
ports. localhost may also resolve to ::1, where nothing listens: that pair must not fail
requests the 127.0.0.1 pair can serve."""

from __future__ import annotations

import re
import shutil
import tempfile
import urllib.request
from pathlib import Path

import grpc
import pytest

from models.tiny.talker import ensure_tiny_checkpoint
from tests.conftest import StageGroup
from voxring.v1 import common_pb2, synthesizer_pb2_grpc
from voxring.v1 import synthesizer_pb2 as pb

SPF = 1920


@pytest.fixture(scope="module")
def discovered_stack(model_cache):
    ensure_tiny_checkpoint(root=model_cache / "models")
    d = Path(tempfile.mkdtemp(prefix="vx-disc-", dir="/tmp"))
    stages = StageGroup(d)
    try:
        server = "drain_timeout: 5, grace: 1"
        talker = stages.start("talker", f"server: {{listen: '127.0.0.1:0', {server}}}\n"
                              "engine: {k_max: 4, buckets: [1, 2, 4], max_num_seqs: 4,"
                              " max_len: 512}\n", timeout=30).address
        code2wav = stages.start("code2wav", f"server: {{listen: '127.0.0.1:0', {server}}}\n"
                                "engine: {max_slots: 8}\n"
                                f"talkers: {{attach: [{{id: talker-0, address: '{talker}'}}]}}\n",
                                timeout=30).address
        talker_port, code2wav_port = (int(a.rpartition(":")[2]) for a in (talker, code2wav))
        gateway = stages.start(
            "gateway", f"server: {{listen: 'unix:{d}/gateway.sock', {server}}}\n"
            f"engines: {{pairs: [], discovery: {{service: localhost, talker_port: {talker_port},"
            f" code2wav_port: {code2wav_port}, refresh_s: 0.5}}}}\n"
            "limits: {default_audio_seconds: 1.0}\n"
            "metrics: {listen: '127.0.0.1:0'}\n", timeout=30)
        with grpc.insecure_channel(f"unix:{d}/gateway.sock") as channel:
            yield {"gateway": synthesizer_pb2_grpc.SynthesizerStub(channel),
                   "metrics": gateway.ready()["metrics"], "dir": d, "talker_port": talker_port}
    finally:
        codes = stages.close()
        shutil.rmtree(d, ignore_errors=True)
    assert codes == dict.fromkeys(stages.stages, 0), f"not every stage exited 0: {codes}"


def test_a_discovered_pair_serves_real_synthesis(discovered_stack):
    stub = discovered_stack["gateway"]
    for seed in (3, 4, 5):  # every request, not just the first, finds the reachable pair
        messages = list(stub.SynthesizeOnline(pb.SynthesizeSpeechRequest(
            text="Found by DNS.", seed=seed), timeout=120))
        final = messages[-1]
        pcm = b"".join(m.audio for m in messages)
        assert final.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert final.usage.frames > 0 and len(pcm) // 2 == final.usage.frames * SPF
    with urllib.request.urlopen(f"http://{discovered_stack['metrics']}/metrics", timeout=10) as reply:
        scraped = reply.read().decode()
    pairs = float(re.search(r"^voxring_engine_pairs (\S+)$", scraped, re.M).group(1))
    assert pairs >= 1  # 127.0.0.1, and ::1 where localhost resolves to it too
    log = (discovered_stack["dir"] / "gateway.log").read_text()
    assert f"engine pair pair-127.0.0.1 added (talker 127.0.0.1:{discovered_stack['talker_port']}" in log
