"""A tiny CSM checkpoint written by transformers itself (the test oracle's side)."""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA3_BACKBONE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                   "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 64}
LLAMA3_DEPTH = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "high_freq_factor": 0.0078125, "low_freq_factor": 0.001953125,
                "original_max_position_embeddings": 4}


def tiny_csm_config(**overrides):
    """A CsmConfig of the real architecture with tiny sizes (8 codebooks of 64 codes)."""
    from transformers import CsmConfig, MimiConfig
    from transformers.models.csm.configuration_csm import CsmDepthDecoderConfig

    mimi = MimiConfig(hidden_size=32, num_filters=4, codebook_size=64, codebook_dim=16,
                      num_quantizers=8, num_semantic_quantizers=1, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                      intermediate_size=64, sliding_window=8, upsampling_ratios=[8, 6, 5, 4],
                      num_residual_layers=1, upsample_groups=32,
                      vector_quantization_hidden_dimension=16,
                      layer_scale_initial_scale=1.0)  # so the transformer shapes the audio
    depth = CsmDepthDecoderConfig(num_codebooks=8, backbone_hidden_size=96, vocab_size=67,
                                  hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=9, rope_parameters=dict(LLAMA3_DEPTH))
    fields = dict(num_codebooks=8, vocab_size=67, text_vocab_size=260, hidden_size=96,
                  intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=256,
                  pad_token_id=258, audio_token_id=258, audio_eos_token_id=259,
                  codebook_pad_token_id=66, rope_parameters=dict(LLAMA3_BACKBONE),
                  depth_decoder_config=depth.to_dict(), codec_config=mimi.to_dict())
    fields.update(overrides)
    return CsmConfig(**fields)


def randomise_codebooks(mimi) -> None:
    """A fresh Mimi has all-zero codebooks (every code decodes the same): randomise them."""
    with torch.no_grad():
        for name, tensor in mimi.named_buffers():
            if name.endswith("codebook.embed_sum"):
                tensor.normal_()
            elif name.endswith("codebook.cluster_usage"):
                tensor.uniform_(0.5, 2.0)
        for module in mimi.modules():
            if hasattr(module, "_embed"):
                module._embed = None  # derived vectors are cached by transformers


def save_transformers_tiny(folder: Path, seed: int = 0) -> Path:
    """Instantiates the tiny config with a seeded random init, randomises the Mimi
    codebooks, and saves with save_pretrained."""
    from transformers import CsmForConditionalGeneration

    torch.manual_seed(seed)
    model = CsmForConditionalGeneration(tiny_csm_config()).eval()
    randomise_codebooks(model.codec_model)
    model.generation_config._from_model_config = False
    model.save_pretrained(folder)
    return folder


def save_transformers_mimi(folder: Path, seed: int = 0) -> Path:
    """A standalone tiny MimiModel checkpoint (random codebooks), as save_pretrained writes it."""
    from transformers import MimiModel

    torch.manual_seed(seed)
    model = MimiModel(tiny_csm_config().codec_config).eval()
    randomise_codebooks(model)
    model.save_pretrained(folder)
    return folder
