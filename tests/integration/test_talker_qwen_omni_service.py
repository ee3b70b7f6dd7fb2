"""The talker as a real process serving the Qwen2.5-Omni family's tiny default (``model.checkpoint:
tiny:qwen-omni``; real gRPC, real rings): ModelInfo tells a client the family and what it needs; prompts
built as the gateway builds them (ModelInfo's tokenizer, prompt format and a speaker) give frames of one
codebook equal to the model's own offline generation, for several requests at once and for K = 1 and 4
(engine.k_max); greedy requests end at max_frames, sampled ones on the family's stop (an end id).
Sessions: tests/unit/test_talker_qwen_omni.py and, end to end, tests/integration/test_two_families.py."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from tokenizers import Tokenizer

from models.family import PromptSegment
from models.qwen_omni.loader import load_talker
from models.tiny.talker import tiny_folder
from services.gateway.routing import ModelFacts
from services.talker.generate import GenerationRequest, Sampling, generate
from services.transport import TransportSection
from services.transport.layout import FinishReason
from tests.talker_client import RingReader, submit_request
from voxring.v1 import talker_pb2, talker_pb2_grpc

MAX_LEN = 256
CONFIG = """\
server: {{listen: 'unix:{dir}/talker.sock', drain_timeout: 10, grace: 1}}
model: {{checkpoint: 'tiny:qwen-omni'}}
engine: {{k_max: {k_max}, buckets: [1, 2, 4, 8], max_num_seqs: 8, max_len: {max_len}, max_waiting: 8,
          max_pending_frames: 16, stall_timeout: 30, admission_by_slack: false}}
transport: {{liveness_timeout: {liveness}, heartbeat_interval: 0.05}}
"""
TEXTS = ["The second family speaks.", "Batch rows and K do not change a code.", "Short."]
GREEDY_FRAMES, SAMPLED_FRAMES = 80, 100
SEEDS = (0, 6, 8, 9)  # sampled requests: on the tiny default some end on an end id before their max


@pytest.fixture(scope="module")
def cache_dir(model_cache):
    tiny_folder("qwen-omni", root=model_cache / "models")  # made once, before any timed start
    return model_cache


@pytest.fixture(params=[1, 4], ids=["k1", "k4"])
def talker(request, start_stage, sock_dir, cache_dir):
    config = CONFIG.format(dir=sock_dir, k_max=request.param, max_len=MAX_LEN,
                           liveness=TransportSection().liveness_timeout)
    svc = start_stage("talker", config)
    channel = grpc.insecure_channel(svc.address)
    readers: list[RingReader] = []
    yield talker_pb2_grpc.TalkerStub(channel), readers, request.param
    for reader in readers:
        reader.close()
    channel.close()


def gateway_facts(info: talker_pb2.ModelInfoResponse) -> ModelFacts:
    """The gateway's view of the talker (services/gateway/routing.py, unchanged)."""
    return ModelFacts(info.model_name, Tokenizer.from_str(info.tokenizer_json.decode()), info.prompt_format,
                      info.max_len, info.num_codebooks, info.frame_rate, info.sample_rate, info.family)


def test_codes_equal_the_models_offline_generation(talker, cache_dir):
    stub, readers, k_max = talker
    info = stub.ModelInfo(talker_pb2.ModelInfoRequest(), timeout=10)
    assert info.family == "qwen_omni" and info.model_name == "voxring-tiny-qwen-omni"
    assert (info.num_codebooks, info.frame_rate, info.sample_rate, info.max_len) == (1, 50.0, 24000, MAX_LEN)
    assert {s.name: s.speaker_id for s in info.speakers} == {"Chelsie": 0, "Ethan": 1}
    facts = gateway_facts(info)
    reader = RingReader(stub, "c2w-q")
    readers.append(reader)
    jobs = {h: (facts.prompt_ids(h % 2, text), GREEDY_FRAMES, Sampling()) for h, text in enumerate(TEXTS)}
    jobs.update({10 + i: (facts.prompt_ids(0, TEXTS[0]), SAMPLED_FRAMES, Sampling(temperature=0.9, top_k=40,
                                                                                   seed=seed))
                 for i, seed in enumerate(SEEDS)})
    for handle, (ids, frames, s) in jobs.items():  # back to back: they run as rows of one batch
        stub.Submit(submit_request("c2w-q", handle, ids, max_frames=frames, temperature=s.temperature,
                                   top_k=s.top_k, seed=s.seed), timeout=10)
    reader.wait(list(jobs))
    model = load_talker(tiny_folder("qwen-omni", root=cache_dir / "models"))
    reasons = {}
    for handle, (ids, frames, sampling) in jobs.items():
        codes, finish, _ = reader.result(handle)
        expected = generate(model, [GenerationRequest([PromptSegment(ids)], frames, sampling=sampling)],
                            cache_len=MAX_LEN)[0]
        assert codes.shape == (len(expected.codes), 1) or not len(codes), codes.shape
        np.testing.assert_array_equal(codes.reshape(-1), expected.codes.numpy().reshape(-1),
                                      err_msg=f"handle {handle}")
        want = FinishReason.STOP if expected.finish_reason == "stop" else FinishReason.LENGTH
        assert finish == want, (handle, finish, expected.finish_reason)
        reasons[handle] = finish
    assert all(reasons[h] == FinishReason.LENGTH for h in range(len(TEXTS)))  # greedy: max_frames exactly
    assert FinishReason.STOP in reasons.values(), "no request ended on an end id: a weaker test"
    k = stub.Stats(talker_pb2.TalkerStatsRequest(), timeout=10).mean_frames_per_step
    assert k == 1.0 if k_max == 1 else k > 1.0, k  # k_max 4: steps carried several frames


