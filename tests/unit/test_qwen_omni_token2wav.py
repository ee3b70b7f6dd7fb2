"""Qwen2.5-Omni Token2Wav without transformers: config parsing and the streaming geometry
(the vocoder's receptive field R against impulse experiments, the DiT's block reach L / A),
the voice conditioning computed once, the RK4 solver, and the strict loader."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from models.checkpoint import CheckpointError
from models.qwen_omni.bigvgan import BigVGAN, DownSample1d, SnakeBeta, UpSample1d
from models.qwen_omni.bigvgan_field import (
    dit_reach_blocks,
    ode_evaluations,
    vocoder_receptive_field,
    vocoder_sample_span,
)
from models.qwen_omni.ode import integrate, time_grid
from models.qwen_omni.token2wav import Token2Wav, load_token2wav
from models.qwen_omni.token2wav_config import BigVGANConfig, DiTConfig, Token2WavConfig

TINY_DIT = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=8, emb_dim=16,
                block_size=4, look_ahead_layers=[1], look_backward_layers=[0, 2], num_embeds=32, mel_dim=10,
                enc_emb_dim=12, enc_dim=8, enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8,
                enc_se_channels=8)
TINY_BIGVGAN = dict(mel_dim=10, upsample_initial_channel=48, upsample_rates=[5, 3, 2, 2],
                    upsample_kernel_sizes=[11, 7, 4, 4])
# the released geometry (rates, kernels, dilations) with few channels: spans ignore channels
REAL_GEOMETRY = dict(upsample_initial_channel=64)


def tiny_config() -> Token2WavConfig:
    return Token2WavConfig.from_dict({"dit_config": TINY_DIT, "bigvgan_config": TINY_BIGVGAN})


def random_(model: torch.nn.Module, seed: int, scale: float = 1.0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p[0].numel()))
    return model.eval()


# --- config -------------------------------------------------------------------------------------


def test_defaults_are_the_released_model_and_its_streaming_geometry():
    config = Token2WavConfig.from_dict({"dit_config": {}, "bigvgan_config": {}})
    dit, big = config.dit, config.bigvgan
    assert (dit.hidden_size, dit.num_layers, dit.num_heads, dit.head_dim) == (1024, 22, 16, 64)
    assert (dit.block_size, dit.repeats, dit.look_back_blocks, dit.look_ahead_blocks) == (24, 2, 2, 1)
    assert dit.layer_look_back[0] == dit.layer_look_back[20] == 1 and dit.layer_look_ahead[10] == 1
    assert dit.block_codes == 12
    assert big.hop_length == 240 and config.samples_per_code == 480
    assert vocoder_receptive_field(config) == 34
    assert dit_reach_blocks(config) == (2, 1)
    assert dit_reach_blocks(config, ode_evaluations(10)) == (72, 36)


def test_original_release_field_names_and_rope_parameters_are_read():
    dit = DiTConfig.from_dict({"dim": 64, "depth": 3, "heads": 2, "rope_parameters": {"rope_theta": 500.0},
                               "enc_channels": [8, 8, 8, 8, 24]})
    assert (dit.hidden_size, dit.num_layers, dit.num_heads, dit.rope_theta) == (64, 3, 2, 500.0)


@pytest.mark.parametrize("dit, big, fragment", [
    ({"rope_parameters": {"rope_type": "yarn"}}, {}, "rope type"),
    ({"enc_channels": [8, 8, 8, 8, 32]}, {}, "sum of enc_channels"),
    ({}, {"upsample_rates": [5, 3]}, "differ in length"),
    ({"mel_dim": 100}, {}, "mel_dim"),
])
def test_unsupported_configs_are_named(dit, big, fragment):
    with pytest.raises(CheckpointError, match=fragment):
        Token2WavConfig.from_dict({"dit_config": dit, "bigvgan_config": big})


def test_from_folder_needs_token2wav_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    with pytest.raises(CheckpointError, match="token2wav_config is missing"):
        Token2WavConfig.from_folder(tmp_path)


# --- the vocoder's receptive field ------------------------------------------------------------


def _linear_positive(config: BigVGANConfig) -> BigVGAN:
    """The vocoder with every weight and filter tap positive, no biases, SnakeBeta ~ identity
    (1/exp(60) sin^2, zero where the input is zero): a linear network without cancellation,
    whose impulse response is non-zero exactly on its reach."""
    model = BigVGAN(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
        for m in model.modules():
            if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d) and m.bias is not None:
                m.bias.zero_()
            if isinstance(m, SnakeBeta):
                m.beta.fill_(60.0)
            if isinstance(m, UpSample1d | DownSample1d):
                m.filter = m.filter.abs().double()
    return model


@pytest.mark.parametrize("geometry", ["tiny", "released"])
def test_sample_span_is_the_exact_reach_of_one_frame(geometry):
    config = BigVGANConfig.from_dict(TINY_BIGVGAN if geometry == "tiny" else REAL_GEOMETRY)
    lo, hi = vocoder_sample_span(config)
    hop, reach = config.hop_length, vocoder_receptive_field(config)
    frames, k = 2 * reach + 8, reach + 4
    impulse = torch.zeros(1, config.mel_dim, frames, dtype=torch.float64)
    impulse[0, 0, k] = 1.0
    with torch.no_grad():
        out = _linear_positive(config).decode(impulse)[0]
    touched = torch.nonzero(out != 0).flatten()
    assert (int(touched.min()) - k * hop, int(touched.max()) - k * hop) == (lo, hi)
    assert max(-(lo // hop), hi // hop) == reach


def test_changing_one_mel_frame_changes_the_wave_only_within_R_frames():
    """The impulse experiment on a random (nonlinear) vocoder: frame k's change reaches only
    the samples of frames [k - R, k + R], and reaches well beyond frame k."""
    config = BigVGANConfig.from_dict(TINY_BIGVGAN)
    reach, hop = vocoder_receptive_field(config), config.hop_length
    assert reach == 33
    model = random_(BigVGAN(config).double(), seed=3)
    frames = 2 * reach + 30
    g = torch.Generator().manual_seed(4)
    mel = torch.rand(1, config.mel_dim, frames, dtype=torch.float64, generator=g) * -6
    for k in (2, frames // 2, frames - 3):
        changed = mel.clone()
        changed[..., k] += 0.5
        with torch.no_grad():
            diff = (model(changed) - model(mel))[0].abs()
        touched = torch.nonzero(diff > 0).flatten()
        first, last = int(touched.min()) // hop, int(touched.max()) // hop
        assert k - reach <= first and last <= k + reach, (k, first, last)
        if k == frames // 2:
            assert first < k - reach // 2 and last > k + reach // 2


# --- the DiT ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    model = Token2Wav(tiny_config())
    random_(model, seed=7)
    return model.eval().requires_grad_(False)


def _utterance(model: Token2Wav, codes: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dit = model.config.dit
    return (torch.randint(0, dit.num_embeds + 1, (1, codes), generator=g),
            torch.randn(1, dit.enc_emb_dim, generator=g), torch.randn(1, 20, dit.mel_dim, generator=g),
            torch.randn(1, codes * dit.repeats, dit.mel_dim, generator=g))


def test_one_dit_evaluation_reaches_L_blocks_back_and_A_ahead(tiny):
    """Changing x in block b changes the velocity of blocks [b - A, b + L] and no other: output
    block i reads input blocks [i - L, i + A]."""
    dit, config = tiny.dit, tiny.config.dit
    codes, cond, ref_mel, x = _utterance(tiny, 24, seed=1)
    ctx = dit.context(codes, tiny.voice(cond, ref_mel), guided=True)
    t = torch.tensor(0.3)
    b, size = 6, config.block_size
    changed = x.clone()
    changed[:, b * size:(b + 1) * size] += 1.0
    diff = (dit.velocity(changed, t, ctx) - dit.velocity(x, t, ctx)).abs().amax(dim=(0, 2))
    blocks = sorted({int(i) // size for i in torch.nonzero(diff > 0).flatten()})
    back, ahead = dit_reach_blocks(config)
    assert blocks == list(range(b - ahead, b + back + 1))


def test_the_speaker_encoder_runs_once_per_voice_not_per_evaluation(tiny):
    codes, cond, ref_mel, noise = _utterance(tiny, 8, seed=2)
    calls = []
    hook = tiny.dit.input_embed.spk_encoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        voice = tiny.voice(cond, ref_mel)
        assert len(calls) == 2  # the reference and the guidance's zeros
        first = tiny.dit_sample(codes, voice, noise, steps=4, guidance=0.5)
        again = tiny.dit_sample(codes, voice, noise, steps=4, guidance=0.5)
    finally:
        hook.remove()
    assert len(calls) == 2
    assert torch.equal(first, again) and first.shape == (1, tiny.config.dit.mel_dim, 16)


def test_a_voice_of_batch_one_serves_a_batch(tiny):
    codes, cond, ref_mel, noise = _utterance(tiny, 8, seed=3)
    voice = tiny.voice(cond, ref_mel)
    both = tiny.dit_sample(torch.cat([codes, codes]), voice, torch.cat([noise, noise]), steps=3)
    alone = tiny.dit_sample(codes, voice, noise, steps=3)
    torch.testing.assert_close(both[0], alone[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="noise shape"):
        tiny.dit_sample(codes, voice, noise[:, :-1], steps=3)


def test_rk4_on_the_sway_grid_solves_exponential_growth():
    times = time_grid(10, sway=-1.0, dtype=torch.float64)
    assert float(times[0]) == 0.0 and float(times[-1]) == pytest.approx(1.0)
    assert bool((times[1:] > times[:-1]).all()) and float(times[1]) < 1 / 9  # denser near 0
    y = integrate(lambda t, y: y, torch.ones(3, dtype=torch.float64), times)
    assert float(y[0]) == pytest.approx(math.e, rel=1e-4)
    assert float(time_grid(5, sway=None)[1]) == 0.25


# --- the loader --------------------------------------------------------------------------------


def _save(model: Token2Wav, folder, edit=None):
    folder.mkdir()
    tensors = {f"token2wav.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors["thinker.lm_head.weight"] = torch.zeros(2, 2)
    if edit:
        edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    raw = {"model_type": "qwen2_5_omni",
           "token2wav_config": {"dit_config": TINY_DIT, "bigvgan_config": TINY_BIGVGAN}}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_loads_token2wav_keys_and_equals_the_saved_model(tiny, tmp_path):
    loaded = load_token2wav(_save(tiny, tmp_path / "ok"))
    mel = torch.rand(1, tiny.config.dit.mel_dim, 12, generator=torch.Generator().manual_seed(0)) * -6
    assert torch.equal(loaded.vocode(mel)[1], tiny.vocode(mel)[1])
    codes, cond, ref_mel, noise = _utterance(tiny, 6, seed=4)
    assert torch.equal(loaded.dit_sample(codes, loaded.voice(cond, ref_mel), noise, steps=3),
                       tiny.dit_sample(codes, tiny.voice(cond, ref_mel), noise, steps=3))


@pytest.mark.parametrize("edit, named", [
    (lambda t: t.pop("token2wav.code2wav_dit_model.proj_out.weight"),
     "missing keys: token2wav.code2wav_dit_model.proj_out.weight"),
    (lambda t: t.__setitem__("token2wav.code2wav_bigvgan_model.conv_post.weight", torch.zeros(1, 3, 5)),
     "wrong shapes: token2wav.code2wav_bigvgan_model.conv_post.weight"),
    (lambda t: t.__setitem__("token2wav.code2wav_bigvgan_model.conv_post.bias", torch.zeros(1)),
     "unexpected keys: token2wav.code2wav_bigvgan_model.conv_post.bias"),
])
def test_a_missing_misshaped_or_unexpected_key_is_named(tiny, tmp_path, edit, named):
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        load_token2wav(_save(tiny, tmp_path / "bad", edit))
