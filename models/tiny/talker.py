"""``voxring-tiny``: the default model, generated locally and deterministically.

A tiny checkpoint of the real CSM architecture (a few layers, 8 codebooks of 64 codes)
written in the layout transformers' ``save_pretrained`` uses: ``config.json`` (with a
tiny Mimi ``codec_config``), ``model.safetensors`` (talker and codec weights, the codec
part from models/tiny/codec.py) and a byte-level tokenizer built with the
``tokenizers`` library. Nothing is downloaded. The same seed gives byte-identical
files. It is untrained: its audio is noise-like.

:func:`ensure_tiny_checkpoint` creates it on first use in the cache folder, under a
file lock, writing into a temporary folder that is renamed into place, so processes
that start together all end up with the same complete checkpoint.

:func:`checkpoint_folder` resolves a stage's ``model.checkpoint``: a folder, null (voxring-tiny)
or ``tiny:NAME``, a family's tiny default (``tiny:csm``, ``tiny:qwen-omni``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from models.checkpoint import CheckpointError, ensure_generated

GENERATOR_VERSION = 3
NAME = "voxring-tiny"
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>")
NUM_CODEBOOKS = 8
CODEBOOK_SIZE = 64
AUDIO_VOCAB = CODEBOOK_SIZE + 3  # codes + specials, as csm-1b's 2048 + 3

_LLAMA3_BACKBONE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                    "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                    "original_max_position_embeddings": 128}
_LLAMA3_DEPTH = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                 "high_freq_factor": 0.0078125, "low_freq_factor": 0.001953125,
                 "original_max_position_embeddings": 4}


def tiny_config() -> dict:
    """config.json of voxring-tiny (a CsmConfig in transformers' field names)."""
    text_vocab = 256 + len(SPECIAL_TOKENS)
    return {
        "architectures": ["CsmForConditionalGeneration"], "model_type": "csm",
        "num_codebooks": NUM_CODEBOOKS, "vocab_size": AUDIO_VOCAB, "text_vocab_size": text_vocab,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_parameters": dict(_LLAMA3_BACKBONE), "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 256, "eos_token_id": None, "pad_token_id": 258, "audio_token_id": 258,
        "audio_eos_token_id": 259, "codebook_eos_token_id": 0,
        "codebook_pad_token_id": AUDIO_VOCAB - 1, "tie_codebooks_embeddings": True,
        "tie_word_embeddings": False, "dtype": "float32",
        "depth_decoder_config": {
            "model_type": "csm_depth_decoder_model", "num_codebooks": NUM_CODEBOOKS,
            "backbone_hidden_size": 128, "vocab_size": AUDIO_VOCAB, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": NUM_CODEBOOKS + 1,
            "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_parameters": dict(_LLAMA3_DEPTH),
            "attention_bias": False, "mlp_bias": False,
        },
        "codec_config": {
            "model_type": "mimi", "sampling_rate": 24000, "audio_channels": 1,
            "hidden_size": 32, "num_filters": 4, "num_residual_layers": 1,
            "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3,
            "residual_kernel_size": 3, "dilation_growth_rate": 2, "use_causal_conv": True,
            "pad_mode": "constant", "compress": 2, "trim_right_ratio": 1.0,
            "codebook_size": CODEBOOK_SIZE, "codebook_dim": 16, "num_quantizers": NUM_CODEBOOKS,
            "num_semantic_quantizers": 1, "upsample_groups": 32,
            "vector_quantization_hidden_dimension": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 64, "hidden_act": "gelu", "sliding_window": 8,
            "max_position_embeddings": 8000, "norm_eps": 1e-5, "layer_scale_initial_scale": 0.01,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    }


def build_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: ids 0..255 are bytes, then the CSM special tokens; every
    encoded text is wrapped in <|begin_of_text|> ... <|end_of_text|>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    bos, eos = SPECIAL_TOKENS[:2]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, 256), (eos, 257)])
    return tokenizer


def tiny_weights(config: dict, seed: int, *, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Seeded weights for every talker tensor of the on-disk layout, returned on the CPU.

    The defaults give voxring-tiny's bytes. ``config`` may be any CSM config (the
    benchmarks pass csm-1b's shapes): ``dtype`` casts each tensor as soon as it is drawn
    (a full-size model then never exists in fp32 at once) and ``device`` draws the numbers
    there (a CUDA generator is much faster for 1.6 B parameters; its stream differs from
    the CPU's, so the values differ, the distribution does not)."""
    from models.csm.config import CsmConfig
    from models.csm.loader import TIED, build_meta

    model = build_meta(CsmConfig.from_dict(config))
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device)

    tensors = {}
    for name, param in sorted(model.named_parameters(remove_duplicate=False)):
        if name in TIED:
            continue
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * randn(param.shape)
        elif "embed" in name:
            tensor = randn(param.shape)
        else:
            fan_in = param.shape[-2] if name.endswith("codebooks_head.weight") else param.shape[-1]
            tensor = randn(param.shape) / fan_in ** 0.5
        if dtype is not None:
            tensor = tensor.to(dtype)
        tensors[name] = tensor.contiguous().cpu()
    return tensors


def write_tiny_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """Writes voxring-tiny into ``folder`` (created). Same seed, same bytes."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    from models.tiny.codec import codec_weights

    tensors = {**tiny_weights(config, seed), **codec_weights(config["codec_config"], seed)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer().save(str(folder / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
                        "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
                        "audio_token": SPECIAL_TOKENS[2], "audio_eos_token": SPECIAL_TOKENS[3],
                        "model_max_length": config["max_position_embeddings"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (folder / "voxring.json").write_text(json.dumps(
        {"name": NAME, "generator_version": GENERATOR_VERSION, "seed": seed}, indent=2) + "\n")
    return folder


def ensure_tiny_checkpoint(seed: int = 0, root: str | Path | None = None) -> Path:
    """The voxring-tiny folder for ``seed``, created on first use (safe across processes)."""
    return ensure_generated(f"{NAME}-v{GENERATOR_VERSION}-seed{seed}",
                            lambda folder: write_tiny_checkpoint(folder, seed), root)


TINY_PREFIX = "tiny:"
# ``model.checkpoint: tiny:NAME``: the tiny default of a family (services/common/sections.py lists the
# same names, to refuse another when the config is read)
TINY_CHECKPOINTS = ("csm", "qwen-omni")


def tiny_folder(name: str, seed: int = 0, root: str | Path | None = None) -> Path:
    """The tiny default named ``name`` (``TINY_CHECKPOINTS``), made on first use: ``csm`` is
    voxring-tiny, ``qwen-omni`` models/qwen_omni/tiny.py's. CheckpointError for another name."""
    if name == "csm":
        return ensure_tiny_checkpoint(seed, root)
    if name == "qwen-omni":
        from models.qwen_omni.tiny import ensure_tiny_checkpoint as ensure_qwen_omni

        return ensure_qwen_omni(seed, root)
    raise CheckpointError(f"{TINY_PREFIX}{name}: no such tiny default (one of "
                          f"{', '.join(TINY_PREFIX + n for n in TINY_CHECKPOINTS)})")


def checkpoint_folder(model_section) -> Path:
    """The folder a stage's ``model`` config section names: its checkpoint folder, a family's tiny
    default for ``tiny:NAME`` (``tiny_seed`` picks which), or voxring-tiny when it is null; a
    tiny default is made on first use."""
    checkpoint = model_section.checkpoint
    if not checkpoint:
        return ensure_tiny_checkpoint(model_section.tiny_seed)
    if checkpoint.startswith(TINY_PREFIX):
        return tiny_folder(checkpoint[len(TINY_PREFIX):], model_section.tiny_seed)
    return Path(checkpoint)
