"""Qwen2.5-Omni Token2Wav against transformers' Qwen2_5OmniToken2WavModel (CPU, fp32, eval):
the same tiny random checkpoint on both sides, the same initial noise injected into
transformers' ``torch.randn`` and passed to ours; the mel of the whole ODE solve and the
vocoder's wave before its clamp within 1e-4 absolute.

The random weights are drawn so the comparison is not vacuous (transformers' own init,
N(0, 0.02) with zero biases, gives a DiT that barely moves the noise and a wave of ~1e-6):
every weight N(0, 1/fan_in), biases N(0, 0.1), SnakeBeta log-alpha/beta N(0, 0.3), code
embeddings N(0, 1); the DiT's output bias shifted by -3 so the mel sits at a speech-like
log level (its dB mapping unclamped for most bins), and the vocoder's conv_post scaled by
0.15 so the wave stays inside [-1, 1]. The test asserts it does (< 1% of samples at +-1),
that exp(mel) is finite, and that mel and wave have real spread.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from models.qwen_omni.token2wav import load_token2wav

transformers = pytest.importorskip("transformers")

TINY_DIT = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=8, ff_mult=2,
                emb_dim=16, block_size=4, look_ahead_layers=[1], look_backward_layers=[0, 2], repeats=2,
                num_embeds=32, mel_dim=10, max_position_embeddings=1024, enc_emb_dim=12, enc_dim=8,
                enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=2,
                enc_se_channels=8)
TINY_BIGVGAN = dict(mel_dim=10, upsample_initial_channel=48, resblock_kernel_sizes=[3, 7, 11],
                    resblock_dilation_sizes=[[1, 3, 5]] * 3, upsample_rates=[5, 3, 2, 2],
                    upsample_kernel_sizes=[11, 7, 4, 4])
CODES, REF_FRAMES = 24, 30  # 48 mel frames = 12 attention blocks of 4; 2880 samples
TOL = 1e-4


def randomise(model: torch.nn.Module, seed: int) -> None:
    """The test's weight draw (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".alpha", ".beta")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("codec_embed.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                if ".ups." in name:  # ConvTranspose1d (in, out, k): in * k / stride taps per output
                    fan_in = p.shape[0] * p.shape[2] / 2
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
        model.code2wav_dit_model.proj_out.bias.sub_(3.0)
        model.code2wav_bigvgan_model.conv_post.weight.mul_(0.15)


def save_checkpoint(model: torch.nn.Module, config, folder: Path) -> Path:
    """A Qwen2.5-Omni folder: config.json with token2wav_config, token2wav.* keys (and a
    talker key, another loader's, that ours must skip)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"token2wav.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors["talker.model.norm.weight"] = torch.ones(4)
    save_file(tensors, str(folder / "model.safetensors"))
    raw = {"model_type": "qwen2_5_omni", "enable_audio_output": True, "token2wav_config": config.to_dict()}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniToken2WavConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = Qwen2_5OmniToken2WavConfig(dit_config=TINY_DIT, bigvgan_config=TINY_BIGVGAN)
    torch.manual_seed(0)
    ref = Qwen2_5OmniToken2WavModel(config).eval()
    randomise(ref, seed=1)
    ours = load_token2wav(save_checkpoint(ref, config, tmp_path_factory.mktemp("omni")))
    return ours, ref


def reference_run(ref, codes, cond, ref_mel, noise, steps, guidance, sway):
    """transformers' mel, clamped wave and (hooked at conv_post) pre-clamp wave, with
    ``noise`` as its torch.randn draw."""
    captured = {}
    hook = ref.code2wav_bigvgan_model.conv_post.register_forward_hook(
        lambda module, args, out: captured.__setitem__("pre", out[:, 0]))

    def randn(*shape, **kwargs):
        assert tuple(shape[0] if len(shape) == 1 else shape) == tuple(noise.shape)
        return noise.clone()

    try:
        with torch.no_grad(), mock.patch.object(torch, "randn", side_effect=randn):
            mel = ref.code2wav_dit_model.sample(cond, ref_mel, codes, num_steps=steps,
                                                guidance_scale=guidance, sway_coefficient=sway)
        with torch.no_grad():
            wave = ref.code2wav_bigvgan_model(mel)
    finally:
        hook.remove()
    return mel, wave.reshape(codes.shape[0], -1), captured["pre"]


CASES = {"default-10-steps-cfg-0.5": (1, 10, 0.5, -1.0, 11),  # batch, steps, guidance, sway, seed
         "batch-2-unguided-4-steps": (2, 4, 0.0, -1.0, 12),
         "no-sway-6-steps-cfg-1": (1, 6, 1.0, None, 13)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mel_and_wave_equal_transformers(models, case):
    ours, ref = models
    batch, steps, guidance, sway, seed = CASES[case]
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, TINY_DIT["num_embeds"] + 1, (batch, CODES), generator=g)
    cond = torch.randn(batch, TINY_DIT["enc_emb_dim"], generator=g)
    ref_mel = torch.rand(batch, REF_FRAMES, TINY_DIT["mel_dim"], generator=g) * -6
    noise = torch.randn(batch, CODES * TINY_DIT["repeats"], TINY_DIT["mel_dim"], generator=g)

    want_mel, want_wave, want_pre = reference_run(ref, codes, cond, ref_mel, noise, steps, guidance, sway)
    voice = ours.voice(cond, ref_mel)
    mel = ours.dit_sample(codes, voice, noise, steps=steps, guidance=guidance, sway=sway)
    wave, pre = ours.vocode(mel)

    assert mel.shape == want_mel.shape == (batch, TINY_DIT["mel_dim"], CODES * 2)
    assert pre.shape == want_pre.shape == (batch, CODES * 2 * 60)
    mel_diff = float((mel - want_mel).abs().max())
    pre_diff = float((pre - want_pre).abs().max())
    assert mel_diff < TOL, mel_diff
    assert pre_diff < TOL, pre_diff
    assert float((wave - want_wave).abs().max()) < TOL
    # not vacuous: a finite, spread mel that the solve moved away from the noise, a wave in range
    assert torch.isfinite(torch.exp(mel)).all()
    assert float(mel.std()) > 0.5 and float((mel.transpose(1, 2) - noise).abs().mean()) > 0.5
    assert float(pre.std()) > 0.05
    assert float((wave.abs() >= 1).float().mean()) < 0.01
    print(f"{case}: mel max|diff| {mel_diff:.2e} (mel {float(mel.min()):.2f}..{float(mel.max()):.2f}), "
          f"pre-clamp wave max|diff| {pre_diff:.2e} (std {float(pre.std()):.3f}, max|.| "
          f"{float(pre.abs().max()):.3f}), at +-1: {float((wave.abs() >= 1).float().mean()):.4f}")


def test_vocoder_alone_equals_transformers_on_a_given_mel(models):
    ours, ref = models
    g = torch.Generator().manual_seed(5)
    mel = torch.rand(2, TINY_DIT["mel_dim"], 40, generator=g) * -8 + 1
    captured = {}
    hook = ref.code2wav_bigvgan_model.conv_post.register_forward_hook(
        lambda module, args, out: captured.__setitem__("pre", out[:, 0]))
    with torch.no_grad():
        ref.code2wav_bigvgan_model(mel)
    hook.remove()
    _, pre = ours.vocode(mel)
    assert float((pre - captured["pre"]).abs().max()) < TOL
