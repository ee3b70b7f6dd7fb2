"""The talker engine serving the Qwen2.5-Omni family's tiny default (CPU, fp32): ``model.checkpoint:
tiny:qwen-omni`` picks it (an unknown tiny name is a config error naming model.checkpoint); ModelInfo
tells a client what it needs (family, one codebook, 50 Hz, 24 kHz, a tokenizer and a prompt format that
give the reply turn [speaker's text BOS, text...]); the engine writes each request's reply stream with
its prompt's final chunk (chunked prefill, slots reused, K = 1 and 4: codes equal the eager generation
API's, which the parity test ties to transformers); a session's next segment carries the slot state of
its own prompt; Submit refuses a session or an audio-context turn naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from models.family import PromptSegment
from models.qwen_omni.prompt import split_segments
from models.qwen_omni.tiny import SPEAKER_IDS, SPEAKERS, TEXT_EOS
from models.talkers import family_of
from models.tiny import talker as csm_tiny
from models.tiny.talker import TINY_CHECKPOINTS, checkpoint_folder, tiny_folder
from services.common import sections
from services.common.config import ConfigError, ConfigValueError, load_config
from services.common.errors import InvalidArgument
from services.common.sampling import Sampling
from services.gateway.routing import ModelFacts as GatewayFacts
from services.talker.__main__ import model_info
from services.talker.config import TalkerConfig
from services.talker.engine import TalkerEngine
from services.talker.generate import GenerationRequest, generate
from services.talker.request import FinishReason, TalkerRequest
from services.talker.runner import Runner
from services.talker.scheduler import Scheduler
from services.talker.servicer import ModelFacts, build_request
from tests.unit.session_support import (
    make_session_engine,
    run_until,
    segment,
    segments_of,
    session_request,
    text_ids,
)
from tests.unit.test_talker_engine import ListSink, collect, frozen_clock, run
from voxring.v1 import common_pb2, talker_pb2

MAX_LEN = 128
TEXTS = ["Hello from the second family.", "A longer one, with more bytes to speak and a comma.", "Hi."]
CONTEXT = list(b"<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder("qwen-omni", root=tmp_path_factory.mktemp("qwen-tiny"))


@pytest.fixture(scope="module")
def info(folder):
    family = family_of(folder)
    return model_info(folder, family.load(folder), MAX_LEN, family)


def gateway_facts(info) -> GatewayFacts:
    """What the gateway builds from ModelInfo (services/gateway/routing.py), unchanged."""
    return GatewayFacts(info.model_name, Tokenizer.from_str(info.tokenizer_json.decode()), info.prompt_format,
                        info.max_len, info.num_codebooks, info.frame_rate, info.sample_rate, info.family)


def test_the_tiny_names_agree_and_an_unknown_one_is_a_config_error(tmp_path, monkeypatch):
    assert TINY_CHECKPOINTS == sections.TINY_CHECKPOINTS
    monkeypatch.setenv("VOXRING_CACHE_DIR", str(tmp_path))
    folder = checkpoint_folder(sections.ModelSection(checkpoint="tiny:qwen-omni"))
    assert folder.parent == tmp_path / "models" and family_of(folder).name == "qwen_omni"
    for value in (None, "tiny:csm"):  # null stays voxring-tiny
        assert checkpoint_folder(sections.ModelSection(checkpoint=value)) == csm_tiny.ensure_tiny_checkpoint()
    with pytest.raises(ConfigValueError, match=r"checkpoint: 'tiny:nope' is no tiny default"):
        sections.ModelSection(checkpoint="tiny:nope")
    path = tmp_path / "talker.yaml"
    path.write_text("model: {checkpoint: 'tiny:qwen'}\n")
    with pytest.raises(ConfigError, match=r"model\.checkpoint.*tiny:qwen-omni"):
        load_config(TalkerConfig, path, "talker", environ={})


def test_model_info_tells_the_gateway_what_it_needs(info):
    assert info.family == "qwen_omni" and info.model_name == "voxring-tiny-qwen-omni"
    assert (info.num_codebooks, info.codebook_size, info.frame_rate, info.sample_rate) == (1, 80, 50.0, 24000)
    assert info.max_len == MAX_LEN and info.prompt_format == "<|spk{speaker}|>{text}"
    assert {(s.name, s.speaker_id) for s in info.speakers} == set(SPEAKER_IDS.items())
    facts = gateway_facts(info)
    for name, speaker in SPEAKER_IDS.items():
        ids = facts.prompt_ids(speaker, "Grüß dich!")
        assert ids == [SPEAKERS[name], *"Grüß dich!".encode()]  # byte b is thinker id b
        prompt = split_segments([PromptSegment(ids)])
        assert prompt.text_bos == SPEAKERS[name] and prompt.reply == tuple("Grüß dich!".encode())


def make_engine(model, *, k_max: int, num_slots: int = 4, chunk: int = 16):
    """The engine on ``model`` with a frozen clock (K = k_max after a bucket's first step) and prompts
    prefilled ``chunk`` positions a step."""
    runner = Runner(model, num_slots=num_slots, max_len=MAX_LEN, buckets=[num_slots], k_max=k_max,
                    max_repetition_window=8)
    scheduler = Scheduler(num_slots=num_slots, max_num_seqs=num_slots, k_max=k_max,
                          prefill_token_budget=chunk, max_waiting=64, stall_timeout=5.0, frame_rate=50.0,
                          path_s=0.1, bucket_for=runner.bucket_for, min_chunk_tokens=chunk)
    sink = ListSink()
    return TalkerEngine(runner, scheduler, lambda consumer: sink, clock=frozen_clock), sink


def qwen_request(handle: int, facts: ModelFacts, ids: list[int], *, max_frames: int, context=(),
                 sampling: Sampling | None = None) -> TalkerRequest:
    sampling = sampling or Sampling()
    submit = talker_pb2.SubmitRequest(consumer_id="c", handle=handle, max_frames=max_frames)
    submit.sampling.temperature, submit.sampling.top_k = sampling.temperature, sampling.top_k
    submit.sampling.seed = sampling.seed
    if context:
        submit.segments.add(text_token_ids=context)
    submit.segments.add(text_token_ids=ids)
    return build_request(submit, facts, 0.0)


def servicer_facts(model) -> ModelFacts:
    return ModelFacts(model.num_codebooks, model.codebook_size, model.text_vocab_size, MAX_LEN, 8,
                      model.pack_prompt, model.pack_slot_state, "qwen_omni", model.audio_context)


def test_engine_writes_each_reply_stream_and_equals_generate_for_every_k(folder, info):
    """Six requests through four slots (slots reused), prompts with context prefilled in 16-position
    chunks, three greedy and three sampled (seeded: the sampler is positional): each request's frames
    read its own reply stream, identical for K = 1 and 4 and equal to the eager generation API run on
    each alone, a stop included (an end id mid-step)."""
    prompt_ids = gateway_facts(info).prompt_ids
    texts = [(prompt_ids(i % 2, TEXTS[i % 3]), CONTEXT[: 20 * (i % 3)]) for i in range(6)]
    samplings = [Sampling()] * 3 + [Sampling(temperature=0.9, top_k=40, seed=seed) for seed in (0, 6, 8)]
    model = family_of(folder).load(folder)
    facts = servicer_facts(model)
    results = {}
    for k in (1, 4):
        engine, sink = make_engine(model, k_max=k)
        requests = [qwen_request(h, facts, ids, max_frames=60 + h, context=ctx, sampling=samplings[h])
                    for h, (ids, ctx) in enumerate(texts)]
        assert all(r.slot_state is not None for r in requests)
        run(engine, requests)
        assert engine.counters.prefill_steps > len(requests)  # prompts went in over several steps
        results[k] = collect(sink.records)
    for h, (ids, ctx) in enumerate(texts):
        turns = [PromptSegment(list(ctx)), PromptSegment(ids)] if ctx else [PromptSegment(ids)]
        expected = generate(model, [GenerationRequest(turns, 60 + h, sampling=samplings[h])],
                            cache_len=MAX_LEN)[0]
        for k in (1, 4):
            codes, reason = results[k][h]
            assert codes.shape[1] == 1 or not len(codes)
            np.testing.assert_array_equal(codes.reshape(-1), expected.codes.numpy().reshape(-1),
                                          err_msg=f"handle {h}, K {k}")
            assert reason == (FinishReason.STOP if expected.finish_reason == "stop" else FinishReason.LENGTH)
    assert FinishReason.STOP in {reason for _, reason in results[4].values()}, "no stop: a weaker test"


@torch.inference_mode()
def test_generate_reads_the_reply_stream(folder):
    """The eager API writes the reply stream: without it every frame would read the text PAD."""
    model = family_of(folder).load(folder)
    turns = [PromptSegment([SPEAKERS["Ethan"], *b"Two different replies."])]
    other = [PromptSegment([SPEAKERS["Ethan"], *b"T, then another text."])]  # same first reply token
    a, b = (generate(model, [GenerationRequest(t, 12)], cache_len=MAX_LEN)[0].codes for t in (turns, other))
    assert model.pack_slot_state(turns).tolist() == [*b"wo different replies.", TEXT_EOS]
    assert not torch.equal(a, b)


def test_a_sessions_next_segment_carries_its_own_slot_state(tmp_path):
    """The engine's session path is family-agnostic: a family's slot state is packed from the same
    segments as the segment's prompt and written with its final chunk (here on the CSM tiny, with a
    stand-in state: CSM keeps none)."""
    from models.csm.loader import load_talker
    from models.tiny.talker import write_tiny_checkpoint

    model = load_talker(write_tiny_checkpoint(tmp_path / "csm", seed=0))
    written: list[tuple[list[int], list[list[int]]]] = []
    model.write_slot_state = lambda caches, slots, states: written.append((slots.tolist(), states.tolist()))
    state = lambda segments: np.asarray([len(segments[-1].text_token_ids)], dtype=np.int64)  # noqa: E731
    engine, _ = make_session_engine(model)
    first = session_request(1, text_ids("Hello there."), max_frames=4)
    first.session.pack_state, first.slot_state = state, state([PromptSegment(text_ids("Hello there."))])
    engine.scheduler.add(first)
    run_until(engine, lambda: engine.scheduler.idle.get(("c", 1)) is not None)
    engine.scheduler.append("c", 1, segment(text_ids("And now more words."), max_frames=3, last=True))
    run_until(engine, lambda: first.finish is not None)
    assert written == [([first.slot], [[len(text_ids("Hello there."))]]),
                       ([first.slot], [[len(text_ids("And now more words."))]])]


def test_submit_refuses_an_audio_turn_and_a_short_reply_naming_the_field(folder):
    facts = servicer_facts(family_of(folder).load(folder))
    ids = [SPEAKERS["Chelsie"], *b"Hello."]
    audio = talker_pb2.SubmitRequest(consumer_id="c", handle=2, max_frames=8)
    audio.segments.add(text_token_ids=ids, frames=common_pb2.Frames(num_frames=1, num_codebooks=1,
                                                                   codes=b"\x01\x00"))
    audio.segments.add(text_token_ids=ids)
    short = talker_pb2.SubmitRequest(consumer_id="c", handle=3, max_frames=8)
    short.segments.add(text_token_ids=ids[:1])
    for request, field, needle in ((audio, "segments[0].frames", "no audio-context turns"),
                                   (short, "segments[0]", "the reply turn needs")):
        with pytest.raises(InvalidArgument) as error:
            build_request(request, facts, 0.0)
        assert error.value.field == field and needle in str(error.value), str(error.value)
    plain = build_request(talker_pb2.SubmitRequest(consumer_id="c", handle=4, max_frames=8,
                                                   segments=[talker_pb2.PromptSegment(text_token_ids=ids)]),
                          facts, 0.0)
    assert plain.sampling == Sampling() and plain.slot_state.tolist() == [*b"ello.", TEXT_EOS]


def test_a_session_segment_equals_a_fresh_request_with_the_earlier_text_as_context(folder, info):
    """This family's prompts take no audio: a session's next segment is prefilled again from position 0
    in the same slot, the voice's context and segment 1's text its context, and its codes are
    ``generate``'s for that prompt (greedy); segment 1's are those of the first request alone."""
    prompt_ids = gateway_facts(info).prompt_ids
    ids1, ids2 = prompt_ids(0, TEXTS[0]), prompt_ids(1, TEXTS[1])
    model = family_of(folder).load(folder)
    facts = servicer_facts(model)
    engine, sink = make_session_engine(model, max_len=MAX_LEN)
    submit = talker_pb2.SubmitRequest(consumer_id="c", handle=1, max_frames=40, session=True)
    submit.segments.add(text_token_ids=CONTEXT[:20])
    submit.segments.add(text_token_ids=ids1)
    first = build_request(submit, facts, 0.0)
    engine.scheduler.add(first)
    run_until(engine, lambda: engine.scheduler.idle.get(("c", 1)) is not None)
    engine.scheduler.append("c", 1, segment(ids2, max_frames=50, last=True))
    run_until(engine, lambda: first.finish is not None)
    (frames1, _, _), (frames2, _, _) = segments_of(sink, 1)
    for frames, turns, max_new in (
            (frames1, [PromptSegment(CONTEXT[:20]), PromptSegment(ids1)], 40),
            (frames2, [PromptSegment(CONTEXT[:20]), PromptSegment(ids1), PromptSegment(ids2)], 50)):
        expected = generate(model, [GenerationRequest(turns, max_new)], cache_len=MAX_LEN)[0].codes
        assert len(frames) > 0
        np.testing.assert_array_equal(frames.reshape(-1), expected.numpy().reshape(-1))
    assert first.session.prefill_positions == 20 + 2 + (20 + len(ids1) + 2)  # segment 2 prefilled again
    assert first.session.overflows == 0  # a prefill from 0 is this family's way, not a context overflow
