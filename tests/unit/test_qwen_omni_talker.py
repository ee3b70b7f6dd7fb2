"""The Qwen2.5-Omni talker family: config spellings and the real shapes, strict loading (a missing or
misshaped key is named), the deterministic tiny generator, the prompt layout, the frame's rules
(suppressed BOS, end ids banned before min_frames, the penalty's prompt ids, the reply stream) and a
frame that runs on meta tensors (no host sync, no branch on a value) and replays in a CUDA graph."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.sampler_twin import SamplingParams
from models.checkpoint import CheckpointError
from models.family import FrameInputs
from models.qwen_omni.config import QwenOmniTalkerConfig
from models.qwen_omni.loader import build_meta, expected_shapes, is_qwen_omni_folder, load_talker
from models.qwen_omni.prompt import pack_reply, prompt_codec_ids, split_segments, tts_segments
from models.qwen_omni.tiny import (
    CODEC_BOS,
    CODEC_EOS,
    CODEC_MASK,
    CODEC_PAD,
    SPEAKERS,
    TEXT_EOS,
    TEXT_PAD,
    ensure_tiny_checkpoint,
    tiny_config,
    write_tiny_checkpoint,
)

CONTEXT = list(b"ctx")
TEXT = list(b"Hello, tiny talker.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)


@pytest.fixture(scope="module")
def model(tiny):
    return load_talker(tiny)


def _copy(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


def _rewrite(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


# --- config -----------------------------------------------------------------------------------


def test_real_shapes_equal_transformers_on_meta():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniConfig

    config = Qwen2_5OmniConfig()
    with torch.device("meta"):
        ref = transformers.Qwen2_5OmniTalkerForConditionalGeneration(config.talker_config)
    ref_shapes = {f"talker.{n}": tuple(p.shape) for n, p in ref.named_parameters()}
    ours = {n: tuple(s) for n, s in expected_shapes(build_meta(QwenOmniTalkerConfig.from_dict(
        config.to_dict()))).items()}
    assert ours.pop("thinker.model.embed_tokens.weight") == (152064, 3584)
    assert ours == ref_shapes
    parsed = QwenOmniTalkerConfig.from_dict(config.to_dict())
    assert (parsed.frame_rate, parsed.sample_rate, parsed.vocab_size) == (50.0, 24000, 8448)
    assert parsed.end_token_ids == (8292, 8294) and parsed.codec_bos_token_id == 8293
    assert (parsed.text_bos_token_id, parsed.text_eos_token_id, parsed.text_pad_token_id) == (151860, 151861,
                                                                                             151859)


def test_transformers_4x_rope_spelling():
    raw = tiny_config()
    talker = raw["talker_config"]
    del talker["rope_parameters"]
    talker["rope_scaling"] = {"type": "default", "rope_type": "default", "mrope_section": [4, 4, 0]}
    talker["rope_theta"] = 10000.0
    parsed = QwenOmniTalkerConfig.from_dict(raw)
    assert (parsed.rope_theta, parsed.mrope_section) == (10000.0, (4, 4, 0))


@pytest.mark.parametrize(("path", "value", "message"), [
    (("model_type",), "csm", "is not 'qwen2_5_omni'"),
    (("talker_config", "use_sliding_window"), True, "use_sliding_window"),
    (("talker_config", "rope_parameters", "mrope_section"), [4, 4, 4], "mrope_section"),
    (("talker_config", "embedding_size"), 32, "embedding_size 32 differs"),
    (("talker_config", "tts_codec_end_token_id"), 80, "tts_codec_end_token_id 80 is outside"),
    (("talker_config", "hidden_size"), None, "hidden_size must be a positive integer"),
])
def test_bad_configs_are_named(path, value, message):
    raw = tiny_config()
    section = raw
    for key in path[:-1]:
        section = section[key]
    section[path[-1]] = value
    with pytest.raises(CheckpointError, match=message):
        QwenOmniTalkerConfig.from_dict(raw)


# --- the loader -------------------------------------------------------------------------------


def test_loads_every_key_and_ignores_other_stages(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    _rewrite(folder, lambda t: t.update({"token2wav.code2wav_dit_model.x": torch.zeros(2),
                                         "thinker.model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}))
    assert is_qwen_omni_folder(folder)
    model = load_talker(folder)
    disk = {name: tensor for name, tensor in load_file(str(tiny / "model.safetensors")).items()
            if not name.startswith("token2wav.")}  # Token2Wav's keys are Code2Wav's
    params = dict(model.named_parameters())
    assert set(params) == set(disk)
    assert all(torch.equal(params[name], tensor) for name, tensor in disk.items())


@pytest.mark.parametrize("key", ["talker.codec_head.weight", "talker.model.layers.1.self_attn.k_proj.bias",
                                 "thinker.model.embed_tokens.weight"])
def test_a_missing_key_is_named(tiny, tmp_path, key):
    folder = _copy(tiny, tmp_path)
    _rewrite(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"missing keys: {key}"):
        load_talker(folder)


@pytest.mark.parametrize("key", ["talker.thinker_to_talker_proj.weight", "talker.model.norm.weight",
                                 "thinker.model.embed_tokens.weight"])
def test_a_misshaped_key_is_named(tiny, tmp_path, key):
    folder = _copy(tiny, tmp_path)
    _rewrite(folder, lambda t: t.update({key: t[key][:-1].contiguous()}))
    with pytest.raises(CheckpointError, match=f"wrong shapes: {key}: "):
        load_talker(folder)


def test_an_unexpected_talker_key_is_named(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    _rewrite(folder, lambda t: t.update({"talker.lm_head.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys: talker\.lm_head\.weight"):
        load_talker(folder)


# --- the tiny default ---------------------------------------------------------------------------


def test_tiny_default_is_byte_identical_when_generated_twice(tmp_path):
    first, second = ensure_tiny_checkpoint(0, tmp_path / "a"), ensure_tiny_checkpoint(0, tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and "model.safetensors" in names
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert ensure_tiny_checkpoint(0, tmp_path / "a") == first  # made once, then found
    other = write_tiny_checkpoint(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert json.loads((first / "voxring.json").read_text())["speakers"] == SPEAKERS


# --- the prompt ---------------------------------------------------------------------------------


def test_prompt_layout(model):
    segments = tts_segments(TEXT, SPEAKERS["Chelsie"], CONTEXT)
    rows = model.pack_prompt(segments)
    assert rows.tolist() == [[-1, t] for t in CONTEXT] + [[CODEC_PAD, SPEAKERS["Chelsie"]],
                                                          [CODEC_BOS, TEXT[0]]]
    assert pack_reply(segments, TEXT_EOS).tolist() == [*TEXT[1:], TEXT_EOS]
    assert prompt_codec_ids(segments, CODEC_MASK, CODEC_PAD, CODEC_BOS) == [CODEC_MASK] * 3 + [CODEC_PAD,
                                                                                               CODEC_BOS]
    assert model.pack_prompt(tts_segments(TEXT, 260)).shape == (2, 2)
    with pytest.raises(ValueError, match="needs the speaker's text BOS"):
        split_segments(tts_segments([], 260))
    with pytest.raises(ValueError, match="audio-context"):
        split_segments([tts_segments(TEXT, 260)[0].__class__([1], torch.zeros(1, 1))])


def test_embed_packed_equals_prompt_embeds(model):
    prompts = [tts_segments(TEXT, SPEAKERS["Chelsie"], CONTEXT), tts_segments(TEXT[:4], SPEAKERS["Ethan"])]
    packed = [model.pack_prompt(s) for s in prompts]
    batch = np.tile(np.array([-1, 0]), (2, 5, 1))  # the engine's padding rows: codes -1, text 0
    for row, rows in enumerate(packed):
        batch[row, : len(rows)] = rows
    with torch.no_grad():
        embedded = model.embed_packed(torch.from_numpy(batch))
        for row, segments in enumerate(prompts):
            n = len(packed[row])
            reference = model.prompt_embeds(segments)
            # one prompt's rows: the same sums and the same projection, bit for bit
            torch.testing.assert_close(model.embed_packed(torch.from_numpy(packed[row])), reference,
                                       atol=0, rtol=0)
            # in a padded batch the projection's product has another shape: equal up to its rounding
            torch.testing.assert_close(embedded[row, :n], reference, atol=1e-6, rtol=0)


# --- one frame ------------------------------------------------------------------------------------


def _start(model, segments, window=8, min_frames=0, penalty=1.0):
    device = model.talker.codec_head.weight.device
    caches = model.new_caches(1, 64, 1)
    rows = torch.from_numpy(model.pack_prompt(segments))[None].to(device)
    lengths = torch.tensor([rows.shape[1]], device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    hidden = model.prefill(model.embed_packed(rows), lengths, slots, caches)
    model.write_reply(caches, slots, [model.pack_reply(segments)])
    sampling = SamplingParams.from_lists(temperature=[0.0], top_k=[0], top_p=[1.0],
                                         repetition_penalty=[penalty], repetition_window=[window], seed=[0],
                                         device=device)
    inputs = FrameInputs(hidden=hidden, slots=slots, positions=lengths.clone(),
                         frame_index=torch.zeros(1, dtype=torch.int64, device=device),
                         min_frames=torch.tensor([min_frames], device=device), sampling=sampling,
                         history=torch.full((1, 1, window), -1, dtype=torch.int64, device=device))
    return caches, inputs


def _advance(inputs: FrameInputs, out) -> FrameInputs:
    return FrameInputs(hidden=out.hidden, slots=inputs.slots, positions=inputs.positions + 1,
                       frame_index=inputs.frame_index + 1, min_frames=inputs.min_frames,
                       sampling=inputs.sampling, history=out.history)


@torch.inference_mode()
def test_bos_is_never_sampled_and_end_ids_wait_for_min_frames(tiny):
    model = load_talker(tiny)
    head = model.talker.codec_head.weight
    v = head[0].clone()
    head[CODEC_BOS] = 1000 * v      # BOS (suppressed) and EOS (banned until f = 3) lead every frame,
    head[CODEC_EOS] = 999 * v       # unless v . h < 0: then the negated rows take the lead
    head[CODEC_PAD] = -998 * v
    caches, inputs = _start(model, tts_segments(TEXT, SPEAKERS["Chelsie"], CONTEXT), min_frames=3)
    codes, stops = [], []
    for _ in range(5):
        out = model.decode_frame(inputs, caches)
        codes.append(int(out.codes[0, 0]))
        stops.append(bool(out.stop[0]))
        inputs = _advance(inputs, out)
    assert CODEC_BOS not in codes
    assert not set(codes[:3]) & {CODEC_EOS, CODEC_PAD} and stops[:3] == [False] * 3
    assert codes[3] in (CODEC_EOS, CODEC_PAD) and stops[3]


@torch.inference_mode()
def test_the_penalty_counts_the_prompt_codec_ids(model):
    for segments, mask in ((tts_segments(TEXT, 259, CONTEXT), CODEC_MASK), (tts_segments(TEXT, 259), -1)):
        _, inputs = _start(model, segments, window=4)
        history, window = model.penalty_history(inputs)
        assert history.tolist() == [[-1] * 4 + [mask, CODEC_PAD, CODEC_BOS]] and window.tolist() == [7]
    _, inputs = _start(model, tts_segments(TEXT, 259, CONTEXT), window=0)
    assert model.penalty_history(inputs)[1].tolist() == [0]  # no window: no penalty at all


@torch.inference_mode()
def test_frames_read_the_reply_stream_then_text_pad(model):
    segments = tts_segments(TEXT[:3], SPEAKERS["Ethan"], CONTEXT)
    caches, inputs = _start(model, segments)
    expected = [TEXT[1], TEXT[2], TEXT_EOS, TEXT_PAD, TEXT_PAD]
    code = torch.tensor([5])
    for f, text_id in enumerate(expected):
        snapshot = (caches.kv.k.clone(), caches.kv.v.clone())
        hidden = model.step_codes(code, inputs, caches)
        embeds = model.codec_embed(code) + model.text_embed(torch.tensor([text_id]))
        caches.kv.k.copy_(snapshot[0])
        caches.kv.v.copy_(snapshot[1])
        x = model.talker.thinker_to_talker_proj(embeds)[:, None]
        want = model.talker.model(x, caches.kv, inputs.slots, inputs.positions[:, None])[:, 0]
        assert torch.equal(hidden, want), f"frame {f}"
        inputs = FrameInputs(hidden=hidden, slots=inputs.slots, positions=inputs.positions + 1,
                             frame_index=inputs.frame_index + 1, min_frames=inputs.min_frames,
                             sampling=inputs.sampling, history=inputs.history)


def test_decode_frame_runs_on_meta_tensors(tiny):
    """Every op of a frame runs on meta tensors, which hold no values: no ``.item()``, no host copy, no
    Python branch on a tensor's value (any of them raises there)."""
    config = QwenOmniTalkerConfig.from_folder(tiny)
    model = build_meta(config)
    for module in model.modules():
        if hasattr(module, "materialize"):
            module.materialize("meta")
    caches = model.new_caches(4, 32, 2)
    sampling = SamplingParams(**{name: torch.empty(2, dtype=value.dtype, device="meta") for name, value in
                                 vars(SamplingParams.greedy(2)).items()})
    inputs = FrameInputs(hidden=torch.empty(2, config.hidden_size, device="meta"),
                         slots=torch.empty(2, dtype=torch.int64, device="meta"),
                         positions=torch.empty(2, dtype=torch.int64, device="meta"),
                         frame_index=torch.empty(2, dtype=torch.int64, device="meta"),
                         min_frames=torch.empty(2, dtype=torch.int64, device="meta"), sampling=sampling,
                         history=torch.empty(2, 1, 8, dtype=torch.int64, device="meta"))
    with torch.inference_mode():
        out = model.decode_frame(inputs, caches, return_logits=True)
    assert out.codes.shape == (2, 1) and out.stop.shape == (2,)
    assert out.hidden.shape == (2, config.hidden_size)
    assert out.history.shape == (2, 1, 8) and out.logits.shape == (2, 1, config.vocab_size)


@pytest.mark.gpu
def test_decode_frame_replays_in_a_cuda_graph(tiny):
    """The frame captured once and replayed gives the eager frames' codes and hidden states."""
    model = load_talker(tiny, device="cuda")
    segments = tts_segments(TEXT, SPEAKERS["Chelsie"], CONTEXT)

    def frames(graph: bool) -> list[torch.Tensor]:
        with torch.inference_mode():
            caches, inputs = _start(model, segments, penalty=1.1)
            if not graph:
                outs = []
                for _ in range(6):
                    out = model.decode_frame(inputs, caches)
                    outs.append(out.codes.clone())
                    inputs = _advance(inputs, out)
                return outs
            static = inputs
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                model.decode_frame(static, model.new_caches(1, 64, 1))  # warm-up on scratch caches
            torch.cuda.current_stream().wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                out = model.decode_frame(static, caches)
            outs = []
            for _ in range(6):
                cuda_graph.replay()
                outs.append(out.codes.clone())
                static.hidden.copy_(out.hidden)
                static.history.copy_(out.history)
                static.positions.add_(1)
                static.frame_index.add_(1)
            return outs

    eager, replayed = frames(False), frames(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))
