"""Loads a CSM talker from a checkpoint folder in the on-disk transformers layout.

``config.json`` plus ``model.safetensors`` or sharded ``model-*.safetensors`` with
``model.safetensors.index.json``. The model is built on the meta device and the weights
are assigned (no second copy in memory). Strict: a missing, unexpected or wrongly shaped
key is an error listing the keys. ``codec_model.*`` keys belong to Code2Wav and are
skipped here. The tied audio embedding is stored once, as
``depth_decoder.model.embed_tokens.weight``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.checkpoint import parse_dtype, read_tensors
from models.csm.config import CsmConfig
from models.csm.model import CsmTalker
from models.csm.modules import RotaryTable
from models.family import PromptInfo

CODEC_PREFIX = "codec_model."
# Parameters that are one tensor under two names; only the second is on disk.
TIED = {"backbone_model.embed_tokens.embed_audio_tokens.weight": "depth_decoder.model.embed_tokens.weight"}


def build_meta(config: CsmConfig) -> CsmTalker:
    """The model's parameters as meta tensors (shapes only, no memory)."""
    with torch.device("meta"):
        return CsmTalker(config)


def _expected(model: CsmTalker) -> dict[str, torch.Size]:
    shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    for alias in TIED:
        shapes.pop(alias, None)
    return shapes


def load_talker(folder: str | Path, dtype: str | torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> CsmTalker:
    """Loads the talker from ``folder`` in ``dtype`` on ``device``, in eval mode."""
    folder = Path(folder)
    dtype = parse_dtype(dtype)
    config = CsmConfig.from_folder(folder)
    model = build_meta(config)
    tensors = read_tensors(folder, _expected(model), dtype, device, skip_prefixes=(CODEC_PREFIX,))
    for alias, stored in TIED.items():
        tensors[alias] = tensors[stored]
    model.load_state_dict(tensors, strict=True, assign=True)
    model.audio_offsets = (torch.arange(config.num_codebooks, dtype=torch.int64, device=device)
                           * config.audio_vocab_size)
    for module in model.modules():
        if isinstance(module, RotaryTable):
            module.materialize(device)
    return model.eval().requires_grad_(False)


def prompt_info(folder: str | Path) -> PromptInfo:
    """CSM's turn format ``{bos}[{speaker}]{text}{eos}`` with the folder's BOS / EOS tokens
    (``tokenizer_config.json``, else Llama 3's)."""
    names: dict = {}
    for path in (Path(folder) / "voxring.json", Path(folder) / "tokenizer_config.json"):
        if path.exists():
            names.update(json.loads(path.read_text()))
    bos, eos = names.get("bos_token", "<|begin_of_text|>"), names.get("eos_token", "<|end_of_text|>")
    return PromptInfo(prompt_format=f"{bos}[{{speaker}}]{{text}}{eos}")
