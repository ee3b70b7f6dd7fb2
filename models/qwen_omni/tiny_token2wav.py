"""The token-to-wave part of ``voxring-tiny-qwen-omni`` (models/qwen_omni/tiny.py writes it):
a tiny Token2Wav config, seeded weights under ``token2wav.*`` and the speakers' voices
(models/qwen_omni/speakers.py's ``spk_dict.safetensors``). Deterministic, untrained.

The rate is the released model's (DiT repeats 2, BigVGAN hop 240: 50 codes a second, 480 samples a
code at 24 kHz), so the talker's frame rate is the real one; the streaming geometry is the released
one's in small: blocks of 4 codes, L = 2 and A = 1 blocks (look_backward_layers / look_ahead_layers).
The DiT embeds codes 0..``num_codes`` (``num_embeds`` = the talker's code count). The weights are
drawn as the unit tests draw theirs, then the mel is shifted to a speech-like log level and the
vocoder's output scaled to about 0.1 RMS, so the audio is neither saturated nor silent.
"""

from __future__ import annotations

import math

import torch

from models.qwen_omni.token2wav import PREFIX, build_meta, expected_shapes
from models.qwen_omni.token2wav_config import Token2WavConfig

MEL_DIM = 16
REF_MEL_FRAMES = 24
MEL_SHIFT = 3.0        # the DiT's output bias lowered: log-mel about -3, the vocoder's dB map unclamped
WAVE_SCALE = 0.005     # the vocoder's last conv scaled: the random network's wave at about 0.1 RMS
SEED_OFFSET = 1_000_003  # its generator apart from the talker weights'


def tiny_token2wav_config(num_codes: int) -> dict:
    """``token2wav_config`` of the tiny checkpoint's config.json (transformers' field names)."""
    dit = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 8,
           "emb_dim": 16, "ff_mult": 2, "block_size": 8, "look_ahead_layers": [1],
           "look_backward_layers": [0, 2], "repeats": 2, "num_embeds": num_codes, "mel_dim": MEL_DIM,
           "max_position_embeddings": 256, "enc_emb_dim": 12, "enc_dim": 8,
           "enc_channels": [16, 16, 16, 16, 48], "enc_kernel_sizes": [5, 3, 3, 3, 1],
           "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 8, "enc_res2net_scale": 2,
           "enc_se_channels": 8}
    bigvgan = {"mel_dim": MEL_DIM, "upsample_initial_channel": 64, "resblock_kernel_sizes": [3],
               "resblock_dilation_sizes": [[1, 3, 5]], "upsample_rates": [5, 3, 2, 2, 2, 2],
               "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4]}
    return {"model_type": "qwen2_5_omni_token2wav", "dit_config": dit, "bigvgan_config": bigvgan}


def tiny_token2wav_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights of every Token2Wav parameter, by on-disk name (``token2wav.*``), fp32 on the CPU."""
    shapes = expected_shapes(build_meta(Token2WavConfig.from_dict(config)))
    generator = torch.Generator().manual_seed(seed + SEED_OFFSET)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=generator)
        tensor = 0.1 * noise if len(shape) == 1 else noise / math.sqrt(math.prod(shape[1:]))
        if name == "code2wav_dit_model.proj_out.bias":
            tensor = tensor - MEL_SHIFT
        elif name == "code2wav_bigvgan_model.conv_post.weight":
            tensor = tensor * WAVE_SCALE
        tensors[PREFIX + name] = tensor.contiguous()
    return tensors


def tiny_speakers(config: dict, text_bos: dict[str, int], seed: int) -> dict:
    """``{name: (cond, ref_mel, bos_token)}`` for models/qwen_omni/speakers.save_speakers, in
    ``text_bos``' order (a speaker's id is its index): seeded, a log-mel-like reference."""
    dit = config["dit_config"]
    generator = torch.Generator().manual_seed(seed + 2 * SEED_OFFSET)
    speakers = {}
    for name, bos in text_bos.items():
        cond = torch.randn(dit["enc_emb_dim"], generator=generator)
        ref_mel = torch.rand(REF_MEL_FRAMES, dit["mel_dim"], generator=generator) * -6.0
        speakers[name] = (cond, ref_mel, bos)
    return speakers
