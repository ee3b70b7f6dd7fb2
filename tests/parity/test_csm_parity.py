"""The CSM talker against Hugging Face transformers' CsmForConditionalGeneration
(CPU, fp32, greedy): codes exactly equal for 64 frames, backbone and depth-decoder
logits within 1e-5, on

- a checkpoint written by voxring's generator and loaded by transformers, and
- a checkpoint written by transformers' ``save_pretrained`` (a tiny CsmConfig built here,
  llama3 RoPE set explicitly, Mimi codebooks randomised) and loaded by voxring,

for (a) a text-only prompt, (b) a prompt with an audio-context turn, (c) a left-padded
batch of two prompts of different lengths. Ids >= the codec's codebook size are
suppressed on both sides. The stop rule (a frame whose codebooks 0..N-2 are all 0) is
the same on both sides; voxring does not emit the stop frame itself.
"""

from __future__ import annotations

import pytest
import torch

from models.csm.loader import load_talker
from models.family import PromptSegment
from models.tiny.talker import build_tokenizer, ensure_tiny_checkpoint
from services.talker.generate import GenerationRequest, generate
from tests.parity.tiny_reference import save_transformers_tiny

transformers = pytest.importorskip("transformers")
FRAMES = 64
ATOL = 1e-5


@pytest.fixture(scope="module", params=["voxring-generator", "transformers-save_pretrained"])
def pair(request, tmp_path_factory):
    """(voxring model, transformers model) loaded from the same folder."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the voxring checkpoint has no codec weights yet
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "voxring-generator":
        folder = ensure_tiny_checkpoint(seed=0, root=root)
    else:
        folder = save_transformers_tiny(root / "tf-tiny", seed=0)
    ref = transformers.CsmForConditionalGeneration.from_pretrained(folder).eval()
    return load_talker(folder), ref


def _generate_ref(ref, config, **inputs):
    suppress = list(range(config.codebook_size, config.audio_vocab_size))
    with torch.no_grad():
        return ref.generate(**inputs, max_new_tokens=FRAMES, do_sample=False,
                            depth_decoder_do_sample=False, suppress_tokens=suppress,
                            depth_decoder_suppress_tokens=suppress, output_logits=True,
                            return_dict_in_generate=True)


def _ref_depth_logits(ref, prompt_embeds: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """transformers' own logits for every frame, teacher-forced on ``codes`` [F, N]:
    [F, N, V] (codebook 0 from lm_head, 1..N-1 from the depth decoder)."""
    with torch.no_grad():
        frames = ref.backbone_model.embed_tokens(codes[None, :-1])        # [1, F-1, H]
        embeds = torch.cat([prompt_embeds, frames], dim=1)
        hidden = ref.backbone_model(inputs_embeds=embeds).last_hidden_state[0]
        h = hidden[prompt_embeds.shape[1] - 1:]                            # [F, H]
        depth_ids = torch.nn.functional.pad(codes[:, :-1], (1, 0))          # [F, N]
        depth = ref.depth_decoder(input_ids=depth_ids, backbone_last_hidden_state=h).logits
        return torch.cat([ref.lm_head(h)[:, None], depth], dim=1)


def _compare(ours_result, ref_codes, ref_logits_c0, ref_all_logits):
    assert ours_result.finish_reason == "length"
    assert ours_result.codes.shape == (FRAMES, ref_codes.shape[-1])
    assert torch.equal(ours_result.codes, ref_codes), "codes differ from transformers"
    torch.testing.assert_close(ours_result.logits[:, 0], ref_logits_c0, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_result.logits, ref_all_logits, atol=ATOL, rtol=0)


def _text(ids_text: str) -> list[int]:
    return build_tokenizer().encode(ids_text).ids


def test_text_only_prompt(pair):
    ours, ref = pair
    ids = _text("[0]Hello from voxring, the tiny talker.")
    out = _generate_ref(ref, ours.config, input_ids=torch.tensor([ids]))
    result = generate(ours, [GenerationRequest([PromptSegment(ids)], max_frames=FRAMES)],
                      return_logits=True)[0]
    codes = out.sequences[0]
    prompt = ref.embed_text_tokens(torch.tensor([ids]))
    _compare(result, codes, torch.stack(out.logits, 1)[0], _ref_depth_logits(ref, prompt, codes))


def test_prompt_with_an_audio_context_turn(pair):
    """The context turn is laid out as transformers' processor does: its text, its
    frames (summed codebook embeddings), then an all-EOS frame."""
    ours, ref = pair
    config = ours.config
    context_ids, ids = _text("[1]An earlier turn."), _text("[0]And now the reply.")
    frames = torch.randint(0, config.codebook_size, (10, config.num_codebooks),
                           generator=torch.Generator().manual_seed(1))
    eos = torch.full((1, config.num_codebooks), config.codebook_eos_token_id)
    with torch.no_grad():
        embeds = torch.cat([ref.embed_text_tokens(torch.tensor(context_ids)),
                            ref.backbone_model.embed_tokens(torch.cat([frames, eos])[None])[0],
                            ref.embed_text_tokens(torch.tensor(ids))])[None]
    out = _generate_ref(ref, config, inputs_embeds=embeds,
                        attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long))
    segments = [PromptSegment(context_ids, frames), PromptSegment(ids)]
    torch.testing.assert_close(ours.prompt_embeds(segments), embeds[0], atol=0, rtol=0)
    result = generate(ours, [GenerationRequest(segments, max_frames=FRAMES)], return_logits=True)[0]
    codes = out.sequences[0]
    _compare(result, codes, torch.stack(out.logits, 1)[0], _ref_depth_logits(ref, embeds, codes))


def test_left_padded_batch_of_two(pair):
    ours, ref = pair
    short, long = _text("[0]Short one."), _text("[1]A noticeably longer second prompt here.")
    width = len(long)
    pad = ours.config.audio_token_id
    input_ids = torch.tensor([[pad] * (width - len(short)) + short, long])
    mask = torch.tensor([[0] * (width - len(short)) + [1] * len(short), [1] * width])
    out = _generate_ref(ref, ours.config, input_ids=input_ids, attention_mask=mask)
    results = generate(ours, [GenerationRequest([PromptSegment(short)], max_frames=FRAMES),
                              GenerationRequest([PromptSegment(long)], max_frames=FRAMES)],
                       return_logits=True)
    ref_c0 = torch.stack(out.logits, 1)
    for row, ids in enumerate((short, long)):
        prompt = ref.embed_text_tokens(torch.tensor([ids]))
        codes = out.sequences[row]
        _compare(results[row], codes, ref_c0[row], _ref_depth_logits(ref, prompt, codes))


def test_stop_frame_ends_both_the_same_way(pair):
    """Zero heads make every greedy code 0 (ties go to the lowest id), so the first frame
    is a stop frame. transformers keeps it and stops; voxring stops without emitting it.
    A non-zero last codebook does not prevent the stop (it is ignored by the rule)."""
    ours, ref = pair
    ids = _text("[0]Stop.")
    saved = {}
    for model in (ours, ref):
        saved[id(model)] = (model.lm_head.weight.clone(),
                            model.depth_decoder.codebooks_head.weight.clone())
        with torch.no_grad():
            model.lm_head.weight.zero_()
            model.depth_decoder.codebooks_head.weight[:-1].zero_()
    try:
        out = _generate_ref(ref, ours.config, input_ids=torch.tensor([ids]))
        assert out.sequences.shape[1] == 1  # transformers stopped after the stop frame
        assert torch.all(out.sequences[0, 0, :-1] == 0)
        result = generate(ours, [GenerationRequest([PromptSegment(ids)], max_frames=FRAMES)])[0]
        assert result.finish_reason == "stop" and result.codes.shape[0] == 0
        # min_frames: stop frames before it are audio; the first one at f >= 5 stops.
        result = generate(ours, [GenerationRequest([PromptSegment(ids)], max_frames=FRAMES,
                                                   min_frames=5)])[0]
        assert result.finish_reason == "stop" and result.codes.shape[0] == 5
        assert torch.all(result.codes[:, :-1] == 0)
        assert torch.equal(result.codes[0], out.sequences[0, 0])
    finally:
        for model in (ours, ref):
            lm, heads = saved[id(model)]
            with torch.no_grad():
                model.lm_head.weight.copy_(lm)
                model.depth_decoder.codebooks_head.weight.copy_(heads)


def test_max_frames_is_exact(pair):
    ours, _ = pair
    ids = _text("[0]Length.")
    results = generate(ours, [GenerationRequest([PromptSegment(ids)], max_frames=7),
                              GenerationRequest([PromptSegment(ids)], max_frames=3)])
    assert [(r.finish_reason, r.codes.shape[0]) for r in results] == [("length", 7), ("length", 3)]
    assert torch.equal(results[0].codes[:3], results[1].codes)
