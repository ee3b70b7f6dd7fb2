"""A random-weight checkpoint with the real csm-1b + Mimi shapes, written by voxring's own
generator (models/tiny/talker.py), for benchmarks on a machine with no internet.

    python -m bench.server.checkpoint DIR [--tokenizer bpe|byte] [--seed 0] [--dtype bfloat16] [--device auto]

The folder has the layout of a real CSM checkpoint (``config.json`` with a full Mimi
``codec_config``, one ``model.safetensors`` holding the talker's and the codec's
``codec_model.*`` tensors, ``tokenizer.json``, ``tokenizer_config.json``), so the talker,
Code2Wav and transformers' ``CsmForConditionalGeneration.from_pretrained`` all load it.
The shapes set the cost; the values are random: its audio is noise and its codes
practically never form the stop frame (codebooks 0..30 all zero), so a request always
runs to its length cap.

- Talker: the csm-1b shapes of bench/talker/gpu.py (``CSM_1B``), with the text vocabulary
  of 128256 ids. Its tensors are stored in ``--dtype`` (bf16: 3.3 GB).
- Codec: Mimi's real configuration (hidden 512, 64 filters, 32 quantizers of 2048 codes,
  dim 256, an 8-layer decoder transformer; the defaults of transformers'
  MimiConfig, models/mimi/config.py), random codebooks (models/tiny/codec.py), kept
  in fp32 on disk (about 0.3 GB): both loaders cast it to the serving dtype.
- Tokenizer (``--tokenizer``): ``bpe`` (the default), the byte-level BPE of
  bench/server/bpe_tokenizer.py (8,192 learned tokens, then the CSM special tokens: ids
  0..8195), 1.35 tokens a word of the load's corpus (voxring/loads.py), the order of
  csm-1b's Llama-3 tokenizer; or ``byte``, voxring-tiny's byte-level tokenizer (ids 0..259:
  bytes, then the same special tokens), 6.6 tokens a word: five times the prompt positions.
  Every id either makes is below 128256, a valid part of csm-1b's text vocabulary; the
  special token ids in config.json are the chosen tokenizer's.

:func:`ensure_full_checkpoint` writes into a temporary folder renamed into place once
complete, so an interrupted write is never mistaken for a checkpoint and a later run on
the same machine reuses a finished one. The folder's name holds the tokenizer and its file's
digest, so a folder written with another tokenizer (or an older BPE) is never reused for it.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

NAME = "voxring-bench-csm-1b-random"
FORMAT_VERSION = 3  # bump when the written files change: cached folders are then rewritten
TOKENIZERS = ("bpe", "byte")  # --tokenizer: the first is the default
SHAPES = ("csm-1b", "tiny")   # tiny: voxring-tiny's layers and codec, csm-1b's text vocabulary (tests)

# Mimi as csm-1b carries it (transformers' MimiConfig defaults, field names as saved).
MIMI_CONFIG = {
    "model_type": "mimi", "sampling_rate": 24000, "frame_rate": 12.5, "audio_channels": 1,
    "hidden_size": 512, "num_filters": 64, "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4],
    "kernel_size": 7, "last_kernel_size": 3, "residual_kernel_size": 3, "dilation_growth_rate": 2,
    "use_causal_conv": True, "pad_mode": "constant", "compress": 2, "trim_right_ratio": 1.0,
    "codebook_size": 2048, "codebook_dim": 256, "num_quantizers": 32, "use_conv_shortcut": False,
    "vector_quantization_hidden_dimension": 256, "num_semantic_quantizers": 1, "upsample_groups": 512,
    "num_hidden_layers": 8, "intermediate_size": 2048, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "gelu", "max_position_embeddings": 8000,
    "initializer_range": 0.02, "norm_eps": 1e-5, "use_cache": False, "sliding_window": 250,
    "attention_dropout": 0.0, "layer_scale_initial_scale": 0.01, "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def tokenizer_json(tokenizer: str = "bpe") -> str:
    """The text of the checkpoint's tokenizer.json: the committed BPE file as it is, or the
    byte-level tokenizer as models/tiny/talker.py writes it."""
    if tokenizer == "bpe":
        from bench.server.bpe_tokenizer import TOKENIZER_JSON

        return TOKENIZER_JSON.read_text(encoding="utf-8")
    if tokenizer == "byte":
        from models.tiny.talker import build_tokenizer

        return build_tokenizer().to_str(pretty=True)
    raise ValueError(f"tokenizer: unknown {tokenizer!r} (one of {', '.join(TOKENIZERS)})")


def tokenizer_digest(tokenizer: str = "bpe") -> str:
    """The first 8 hex digits of tokenizer.json's sha256: part of the cached folder's name."""
    return hashlib.sha256(tokenizer_json(tokenizer).encode()).hexdigest()[:8]


def special_ids(tokenizer: str = "bpe") -> dict[str, int]:
    """config.json's special token ids for ``tokenizer`` (bpe_tokenizer.special_token_ids)."""
    from tokenizers import Tokenizer

    from bench.server.bpe_tokenizer import special_token_ids

    return special_token_ids(Tokenizer.from_str(tokenizer_json(tokenizer)))


def full_config(dtype: str = "bfloat16", tokenizer: str = "bpe", shapes: str = "csm-1b") -> dict:
    """config.json: csm-1b's shapes (bench/talker/gpu.py's CSM_1B; ``shapes="tiny"``:
    voxring-tiny's layers and codec with csm-1b's text vocabulary) completed with the fields a
    loadable checkpoint needs, ``tokenizer``'s special ids and real Mimi."""
    from bench.talker.gpu import CSM_1B
    from models.tiny.talker import tiny_config

    tiny = tiny_config()
    if shapes == "tiny":
        return {**tiny, **special_ids(tokenizer), "text_vocab_size": CSM_1B["text_vocab_size"],
                "dtype": dtype}
    if shapes != "csm-1b":
        raise ValueError(f"shapes: unknown {shapes!r} (one of {', '.join(SHAPES)})")
    config = copy.deepcopy(CSM_1B)
    depth = config["depth_decoder_config"]
    for key in ("rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias"):
        config.setdefault(key, tiny[key])
        depth.setdefault(key, tiny["depth_decoder_config"][key])
    depth.setdefault("model_type", "csm_depth_decoder_model")
    config.update({
        "architectures": ["CsmForConditionalGeneration"],
        # the tokenizer's ids (bos, pad = audio, audio_eos), all < text_vocab_size
        **special_ids(tokenizer), "eos_token_id": None,
        "codebook_eos_token_id": 0, "codebook_pad_token_id": config["vocab_size"] - 1,
        "tie_codebooks_embeddings": True, "tie_word_embeddings": tiny["tie_word_embeddings"], "dtype": dtype,
        "codec_config": dict(MIMI_CONFIG),
    })
    return config


def write_full_checkpoint(folder: str | Path, seed: int = 0, dtype: str = "bfloat16",
                          device: str = "auto", tokenizer: str = "bpe", shapes: str = "csm-1b") -> Path:
    """Writes the checkpoint into ``folder`` (created); returns it."""
    import torch
    from safetensors.torch import save_file

    from models.checkpoint import parse_dtype
    from models.tiny.codec import codec_weights
    from models.tiny.talker import tiny_weights

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    config = full_config(dtype, tokenizer, shapes)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = tiny_weights(config, seed, dtype=parse_dtype(dtype), device=device)
    tensors.update(codec_weights(config["codec_config"], seed))  # fp32: ~79 M parameters
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    (folder / "tokenizer.json").write_text(tokenizer_json(tokenizer), encoding="utf-8")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                        "eos_token": "<|end_of_text|>", "pad_token": "<|AUDIO|>",
                        "audio_token": "<|AUDIO|>", "audio_eos_token": "<|audio_eos|>",
                        "model_max_length": config["max_position_embeddings"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (folder / "voxring.json").write_text(json.dumps(
        {"name": NAME, "format_version": FORMAT_VERSION, "seed": seed, "dtype": dtype, "shapes": shapes,
         "tokenizer": tokenizer, "tokenizer_digest": tokenizer_digest(tokenizer)}, indent=2) + "\n")
    return folder


def checkpoint_name(seed: int = 0, dtype: str = "bfloat16", tokenizer: str = "bpe") -> str:
    """``<name>-v<version>-seed<seed>-<dtype>-<tokenizer>-<digest of its tokenizer.json>``."""
    return f"{NAME}-v{FORMAT_VERSION}-seed{seed}-{dtype}-{tokenizer}-{tokenizer_digest(tokenizer)}"


def ensure_full_checkpoint(root: str | Path, seed: int = 0, dtype: str = "bfloat16",
                           device: str = "auto", tokenizer: str = "bpe") -> tuple[Path, bool]:
    """(folder, written now): ``root/<checkpoint_name>``, written on first use through a
    temporary folder renamed into place (a partial write is never reused)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(seed, dtype, tokenizer)
    if (final / "voxring.json").is_file():
        return final, False
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        write_full_checkpoint(tmp, seed, dtype, device, tokenizer)
        os.chmod(tmp, 0o755)
        if final.exists():  # a leftover without voxring.json: incomplete
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, True


def default_root() -> Path:
    """Where the benchmark keeps the checkpoint between its parts on one machine."""
    return Path(tempfile.gettempdir()) / "voxring-bench-checkpoints"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path, nargs="?", default=None,
                        help=f"folder that receives the checkpoint folder (default {default_root()})")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default=TOKENIZERS[0],
                        help="bpe: bench/server/bpe_tokenizer.json (about 1.35 tokens a word); "
                             "byte: voxring-tiny's byte-level tokenizer (about 6.6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto", help="where the numbers are drawn: auto, cpu, cuda")
    args = parser.parse_args(argv)
    started = time.monotonic()
    folder, written = ensure_full_checkpoint(args.dir or default_root(), args.seed, args.dtype, args.device,
                                             args.tokenizer)
    size = sum(f.stat().st_size for f in folder.iterdir())
    verb = "wrote" if written else "found"
    print(f"{verb} {folder} ({size / 1e9:.2f} GB) in {time.monotonic() - started:.1f} s", flush=True)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
