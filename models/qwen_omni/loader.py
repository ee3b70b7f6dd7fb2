"""Loads the Qwen2.5-Omni talker from a checkpoint folder in transformers' Qwen2.5-Omni layout.

``config.json`` (``model_type`` ``qwen2_5_omni``) plus ``model.safetensors`` or shards with
``model.safetensors.index.json``. The talker reads two parts of it: every ``talker.*`` key (strict:
a missing, unexpected or wrongly shaped one is an error naming it) and the thinker's token table
``thinker.model.embed_tokens.weight``; the rest of the thinker and the ``token2wav.*`` keys belong to
other loaders and are not read. The model is built on the meta device and the weights are assigned
(no second copy in memory).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.checkpoint import CheckpointError, parse_dtype, read_config_json, read_tensors
from models.family import PromptInfo
from models.qwen_omni.config import QwenOmniTalkerConfig, is_qwen_omni
from models.qwen_omni.talker import QwenOmniTalker
from models.qwen_omni.talker_layers import MRotary

TALKER_PREFIX = "talker."
THINKER_EMBED_PREFIX = "thinker.model.embed_tokens."


def build_meta(config: QwenOmniTalkerConfig) -> QwenOmniTalker:
    """The model's parameters as meta tensors (shapes only, no memory)."""
    with torch.device("meta"):
        return QwenOmniTalker(config)


def expected_shapes(model: QwenOmniTalker) -> dict[str, torch.Size]:
    """Every on-disk key of the talker (with its prefix) and its shape."""
    return {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}


def is_qwen_omni_folder(folder: str | Path) -> bool:
    """Whether the checkpoint folder's config.json names this family (how a stage picks its loader)."""
    return is_qwen_omni(read_config_json(folder)[1])


def load_talker(folder: str | Path, dtype: str | torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> QwenOmniTalker:
    """Loads the talker from ``folder`` in ``dtype`` on ``device``, in eval mode."""
    folder = Path(folder)
    dtype = parse_dtype(dtype)
    config = QwenOmniTalkerConfig.from_folder(folder)
    model = build_meta(config)
    shapes = expected_shapes(model)
    parts = {prefix: {name[len(prefix):]: shape for name, shape in shapes.items() if name.startswith(prefix)}
             for prefix in (TALKER_PREFIX, THINKER_EMBED_PREFIX)}
    if sum(len(p) for p in parts.values()) != len(shapes):
        raise CheckpointError("the talker has parameters outside talker.* and thinker.model.embed_tokens")
    tensors = {}
    for prefix, expected in parts.items():
        read = read_tensors(folder, expected, dtype, device, prefix=prefix)
        tensors.update({prefix + name: tensor for name, tensor in read.items()})
    model.load_state_dict(tensors, strict=True, assign=True)
    for module in model.modules():
        if isinstance(module, MRotary):
            module.materialize(device)
    return model.eval().requires_grad_(False)


def prompt_info(folder: str | Path) -> PromptInfo:
    """The reply turn's format and the speakers, from the folder's ``voxring.json`` (``prompt_format``,
    e.g. the tiny default's ``<|spk{speaker}|>{text}``, whose speaker token is that speaker's text BOS,
    and ``speaker_ids``: name -> the id for ``{speaker}``). A checkpoint without them has no format a
    client could fill in: CheckpointError naming the file."""
    path = Path(folder) / "voxring.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raw = {}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    fmt, ids = raw.get("prompt_format"), raw.get("speaker_ids", {})
    if not isinstance(fmt, str) or "{text}" not in fmt:
        raise CheckpointError(f"{path}: prompt_format (a string with {{text}}, the reply turn "
                              f"[speaker's text BOS, text...] once tokenized) is missing")
    if not isinstance(ids, dict) or not all(isinstance(i, int) and i >= 0 for i in ids.values()):
        raise CheckpointError(f"{path}: speaker_ids must map names to ids >= 0")
    return PromptInfo(prompt_format=fmt, speakers=tuple(sorted(ids.items(), key=lambda item: item[1])))
