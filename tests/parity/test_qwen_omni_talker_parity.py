"""The Qwen2.5-Omni talker against transformers' Qwen2_5OmniTalkerForConditionalGeneration (CPU,
fp32, .eval()), fed as ``Qwen2_5OmniForConditionalGeneration.generate`` feeds it with the thinker's
hidden states zero (a TTS request: the thinker is not run):

* teacher forcing: voxring's per-frame logits (prefill, then ``step_codes`` on given codes) within
  1e-4 of one transformers forward over the same sequence, for 48 frames of random codes;
* generation: greedy codes equal to transformers' ``generate`` with its settings (``suppress_tokens=
  [codec_bos]``, ``eos_token_id=[codec_pad, codec_eos]``, the repetition penalty over the whole
  sequence prompt included, ``min_new_tokens=40``), the raw logits of every step within 1e-4, at
  least 10 distinct codes, for a prompt with context and a bare TTS prompt (no MASK ids);
* a left-padded batch of two prompts equals transformers' batch; either end id stops both alike.

transformers 5.24's ``generate`` drops an all-ones attention mask, and its talker then skips the
in-place addition of the codec PAD / BOS embeddings that it makes when it has a mask (a padded
batch, or transformers 4.x): for an unpadded request the test adds them as that branch does
(``_add_codec_specials``); the padded batch runs transformers' own branch.

On two checkpoints: voxring's tiny generator (loaded into transformers by name) and one whose
config.json is transformers' own ``Qwen2_5OmniConfig.to_dict()`` with transformers-initialised
talker weights (loaded by voxring).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.sampler_twin import SamplingParams
from models.family import FrameInputs
from models.qwen_omni.loader import load_talker
from models.qwen_omni.prompt import split_segments, tts_segments
from models.qwen_omni.tiny import SPEAKERS, ensure_tiny_checkpoint, tiny_config

transformers = pytest.importorskip("transformers")
ATOL = 1e-4
FRAMES = 64
MIN_FRAMES = 40
PENALTY = 1.1
WINDOW = 128  # >= every frame: transformers' penalty reads the whole sequence
CONTEXT = list(b"<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\n")
TEXT = list(b"Hello from voxring: the tiny Qwen talker speaks.")


def _reference(folder: Path):
    """(transformers talker, thinker token table) holding the folder's tensors."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniConfig

    raw = json.loads((folder / "config.json").read_text())
    config = Qwen2_5OmniConfig(**{k: v for k, v in raw.items() if k != "model_type"}).talker_config
    tensors = load_file(str(folder / "model.safetensors"))
    ref = transformers.Qwen2_5OmniTalkerForConditionalGeneration(config).eval()
    ref.load_state_dict({k[len("talker."):]: v for k, v in tensors.items() if k.startswith("talker.")},
                        strict=True)
    table = torch.nn.Embedding.from_pretrained(tensors["thinker.model.embed_tokens.weight"])
    return ref, table


def _transformers_checkpoint(folder: Path, seed: int) -> Path:
    """config.json from transformers' Qwen2_5OmniConfig; talker weights from transformers' own init
    (then spread, so an untrained model's greedy codes vary), a seeded thinker table."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniConfig

    mine = tiny_config()
    talker = {**mine["talker_config"], "num_hidden_layers": 3, "intermediate_size": 80}
    config = Qwen2_5OmniConfig(thinker_config=mine["thinker_config"], talker_config=talker)
    torch.manual_seed(seed)
    ref = transformers.Qwen2_5OmniTalkerForConditionalGeneration(config.talker_config)
    with torch.no_grad():  # transformers' init (std 0.02, zero biases) spread to std 1 / sqrt(fan_in)
        for name, param in ref.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif param.dim() == 2 and "embed" not in name:
                param.mul_(1.0 / (0.02 * param.shape[-1] ** 0.5))
    tensors = {f"talker.{k}": v.contiguous() for k, v in ref.state_dict().items()}
    text = config.thinker_config.text_config
    tensors["thinker.model.embed_tokens.weight"] = torch.randn(text.vocab_size, text.hidden_size)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config.to_json_string())
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module", params=["voxring-generator", "transformers-config"])
def pair(request, tmp_path_factory):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # tiny ids trip transformers' vocabulary range warnings
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "voxring-generator":
        folder = ensure_tiny_checkpoint(seed=0, root=root)
    else:
        folder = _transformers_checkpoint(root / "tf", seed=0)
    return (load_talker(folder), *_reference(folder))


# --- transformers' side, as Qwen2_5OmniForConditionalGeneration.generate builds it -------------


def _ref_inputs(ours, table, requests) -> dict:
    """talker.generate's inputs for a left-padded batch of requests, thinker hidden states zero:
    Qwen2_5OmniForConditionalGeneration.generate's talker_input_ids, talker_input_text_ids,
    talker_inputs_embeds, thinker_reply_part (text EOS after each row's reply, then text PAD) and
    talker_attention_mask (the processor's mask plus two ones)."""
    cfg = ours.config
    parts = [split_segments(s) for s in requests]
    width = max(len(p.context) for p in parts)
    stream = max(len(p.reply) for p in parts) + 1          # reply[1:], EOS, PAD (at least one)
    rows = {"input_ids": [], "input_text_ids": [], "inputs_embeds": [], "thinker_reply_part": [],
            "attention_mask": []}
    with torch.no_grad():
        for p in parts:
            pad = width - len(p.context)
            context = torch.tensor([0] * pad + list(p.context), dtype=torch.long)  # thinker input_ids
            token_embeds = table(context)
            hidden = torch.zeros_like(token_embeds)  # the thinker is not run
            reply = table(torch.tensor(p.reply))
            stream_ids = [cfg.text_eos_token_id] + [cfg.text_pad_token_id] * (stream - len(p.reply))
            rows["inputs_embeds"].append(torch.cat([hidden + token_embeds, table(torch.tensor([p.text_bos])),
                                                    reply[:1]]))
            rows["thinker_reply_part"].append(torch.cat([reply[1:], table(torch.tensor(stream_ids))]))
            rows["input_ids"].append(torch.tensor([cfg.codec_mask_token_id] * width
                                                  + [cfg.codec_pad_token_id, cfg.codec_bos_token_id]))
            rows["input_text_ids"].append(torch.cat([context, torch.tensor([p.text_bos, p.reply[0]])]))
            rows["attention_mask"].append(torch.tensor([0] * pad + [1] * (len(p.context) + 2)))
    return {name: torch.stack(values) for name, values in rows.items()}


def _ref_generate(ref, ours, table, requests, frames=FRAMES, min_frames=MIN_FRAMES):
    """transformers' codes [B, F] (a finished row padded with codec PAD) and raw logits [B, F, V]."""
    cfg = ours.config
    inputs = _ref_inputs(ours, table, requests)
    inputs["inputs_embeds"] = inputs["inputs_embeds"].clone()  # the talker adds codec PAD/BOS in place
    if bool((inputs["attention_mask"] == 1).all()):
        # generate drops an all-ones mask (generation/utils.py: "We can drop the mask altogether if it's
        # all 1s"), and the talker's forward then skips the branch that adds the codec PAD / BOS embeddings
        # (``if attention_mask is not None and position_ids is None``), which it runs for a padded batch:
        # added here as that branch adds them, so an unpadded request is conditioned as the model defines
        _add_codec_specials(ref, cfg, inputs["inputs_embeds"])
    with torch.no_grad():
        out = ref.generate(**inputs, suppress_tokens=[cfg.codec_bos_token_id], do_sample=False,
                           max_new_tokens=frames, min_new_tokens=min_frames,
                           eos_token_id=list(cfg.end_token_ids), pad_token_id=cfg.codec_pad_token_id,
                           repetition_penalty=PENALTY, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.logits, dim=1)


def _add_codec_specials(ref, cfg, embeds: torch.Tensor) -> None:
    """Qwen2_5OmniTalkerForConditionalGeneration.forward's in-place additions at the last two positions."""
    table = ref.get_input_embeddings()
    with torch.no_grad():
        embeds[:, -1, :] += table(torch.tensor([cfg.codec_bos_token_id]))
        embeds[:, -2, :] += table(torch.tensor([cfg.codec_pad_token_id]))


def _ref_forced_logits(ref, ours, table, segments, codes: torch.Tensor) -> torch.Tensor:
    """transformers' logits for frames 0 .. F-1 in one forward over the prompt and ``codes`` [F]."""
    inputs = _ref_inputs(ours, table, [segments])
    with torch.no_grad():
        prompt = inputs["inputs_embeds"].clone()
        _add_codec_specials(ref, ours.config, prompt)
        reply = inputs["thinker_reply_part"]
        index = torch.arange(len(codes) - 1).clamp(max=reply.shape[1] - 1)
        frames = ref.get_input_embeddings()(codes[None, :-1]) + reply[:, index]
        embeds = ref.thinker_to_talker_proj(torch.cat([prompt, frames], dim=1))
        hidden = ref.model(inputs_embeds=embeds).last_hidden_state
        return ref.codec_head(hidden[0, prompt.shape[1] - 1:]).float()


# --- voxring's side -------------------------------------------------------------------------------


def _prefill(ours, requests):
    b = len(requests)
    packed = [ours.pack_prompt(s) for s in requests]
    lengths = torch.tensor([len(p) for p in packed])
    tokens = np.tile(np.array([-1, 0], dtype=np.int64), (b, int(lengths.max()), 1))
    for row, rows in enumerate(packed):
        tokens[row, : len(rows)] = rows
    caches = ours.new_caches(b, int(lengths.max()) + FRAMES + 1, b)
    slots = torch.arange(b)
    hidden = ours.prefill(ours.embed_packed(torch.from_numpy(tokens)), lengths, slots, caches)
    ours.write_reply(caches, slots, [ours.pack_reply(s) for s in requests])
    return caches, slots, lengths, hidden


def _inputs(hidden, slots, lengths, f, history, min_frames=MIN_FRAMES):
    b = len(slots)
    sampling = SamplingParams.from_lists(temperature=[0.0] * b, top_k=[0] * b, top_p=[1.0] * b,
                                         repetition_penalty=[PENALTY] * b, repetition_window=[WINDOW] * b,
                                         seed=[0] * b)
    return FrameInputs(hidden=hidden, slots=slots, positions=lengths + f,
                       frame_index=torch.full((b,), f, dtype=torch.int64),
                       min_frames=torch.full((b,), min_frames, dtype=torch.int64), sampling=sampling,
                       history=history)


@torch.inference_mode()
def _generate(ours, requests, frames=FRAMES, min_frames=MIN_FRAMES):
    """Each row's codes up to and including its stop code, and its logits [F, V]."""
    caches, slots, lengths, hidden = _prefill(ours, requests)
    history = torch.full((len(requests), 1, WINDOW), -1, dtype=torch.int64)
    codes, logits, stopped = [[] for _ in requests], [[] for _ in requests], [False] * len(requests)
    for f in range(frames):
        out = ours.decode_frame(_inputs(hidden, slots, lengths, f, history, min_frames), caches,
                                return_logits=True)
        hidden, history = out.hidden, out.history
        for row in range(len(requests)):
            if not stopped[row]:
                codes[row].append(int(out.codes[row, 0]))
                logits[row].append(out.logits[row, 0])
                stopped[row] = bool(out.stop[row])
    return [(torch.tensor(c), torch.stack(lg)) for c, lg in zip(codes, logits, strict=True)]


@torch.inference_mode()
def _forced_logits(ours, segments, codes: torch.Tensor) -> torch.Tensor:
    caches, slots, lengths, hidden = _prefill(ours, [segments])
    history = torch.full((1, 1, 0), -1, dtype=torch.int64)
    logits = []
    for f in range(len(codes)):
        logits.append(ours.talker.codec_head(hidden)[0].float())
        hidden = ours.step_codes(codes[f:f + 1], _inputs(hidden, slots, lengths, f, history), caches)
    return torch.stack(logits)


# --- the tests ------------------------------------------------------------------------------------

REQUESTS = {"with-context": tts_segments(TEXT, SPEAKERS["Chelsie"], CONTEXT),
            "bare-tts": tts_segments(TEXT[:12], SPEAKERS["Ethan"])}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_teacher_forced_logits(pair, name):
    ours, ref, table = pair
    codes = torch.randint(0, ours.config.vocab_size, (48,), generator=torch.Generator().manual_seed(7))
    expected = _ref_forced_logits(ref, ours, table, REQUESTS[name], codes)
    got = _forced_logits(ours, REQUESTS[name], codes)
    assert got.shape == expected.shape == (48, ours.config.vocab_size)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_greedy_codes_equal_transformers_generate(pair, name):
    ours, ref, table = pair
    segments = REQUESTS[name]
    ref_codes, ref_logits = _ref_generate(ref, ours, table, [segments])
    codes, logits = _generate(ours, [segments])[0]
    print(f"{name}: {len(codes)} codes, {len(set(codes.tolist()))} distinct, "
          f"max |logit diff| {(logits - ref_logits[0, :len(codes)]).abs().max().item():.2e}")
    assert torch.equal(codes, ref_codes[0]), f"codes differ:\n{codes.tolist()}\n{ref_codes[0].tolist()}"
    torch.testing.assert_close(logits, ref_logits[0], atol=ATOL, rtol=0)
    assert len(codes) >= MIN_FRAMES
    assert len(set(codes.tolist())) >= 10, "the test would be vacuous: too few distinct codes"
    forced = _ref_forced_logits(ref, ours, table, segments, codes)
    torch.testing.assert_close(logits, forced, atol=ATOL, rtol=0)


def test_left_padded_batch_equals_transformers(pair):
    """Two prompts of different lengths in one batch: transformers keeps the (padded) attention mask
    and adds the codec PAD / BOS embeddings itself; voxring runs each row in its own slot."""
    ours, ref, table = pair
    requests = [REQUESTS["with-context"], tts_segments(TEXT[5:30], SPEAKERS["Ethan"], CONTEXT[:9])]
    ref_codes, ref_logits = _ref_generate(ref, ours, table, requests)
    for row, (codes, logits) in enumerate(_generate(ours, requests)):
        assert torch.equal(codes, ref_codes[row, :len(codes)]), f"row {row} codes differ"
        torch.testing.assert_close(logits, ref_logits[row, :len(codes)], atol=ATOL, rtol=0)


def test_either_end_id_stops_both_alike(pair):
    """A head whose only non-zero rows are PAD = v and EOS = -v, then the reverse: every code ties at 0
    (greedy takes id 0) until ``min_frames`` lifts the end ids' ban, then the positive end id wins, a
    different one in each variant. transformers keeps the end id and stops; voxring flags that frame
    as the stop frame."""
    ours, ref, table = pair
    cfg = ours.config
    pad, eos = cfg.codec_pad_token_id, cfg.codec_eos_token_id
    heads = (ours.talker.codec_head.weight, ref.codec_head.weight)
    saved = [h.clone() for h in heads]
    stops = set()
    try:
        for sign in (1.0, -1.0):
            for head in heads:
                with torch.no_grad():
                    v = head[0].clone()
                    head.zero_()
                    head[pad], head[eos] = sign * v, -sign * v
            ref_codes, _ = _ref_generate(ref, ours, table, [REQUESTS["with-context"]], min_frames=5)
            codes, _ = _generate(ours, [REQUESTS["with-context"]], min_frames=5)[0]
            assert ref_codes.shape[1] == 6 and torch.equal(codes, ref_codes[0])
            assert codes[:5].tolist() == [0] * 5
            stops.add(int(codes[5]))
            for head, weight in zip(heads, saved, strict=True):
                with torch.no_grad():
                    head.copy_(weight)
    finally:
        for head, weight in zip(heads, saved, strict=True):
            with torch.no_grad():
                head.copy_(weight)
    assert stops == {pad, eos}
