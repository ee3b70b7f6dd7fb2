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
from safetensors import SafetensorError, safe_open

from services.talker.models.csm.config import CheckpointError, CsmConfig
from services.talker.models.csm.model import CsmTalker
from services.talker.models.csm.modules import RotaryTable

CODEC_PREFIX = "codec_model."
# Parameters that are one tensor under two names; only the second is on disk.
TIED = {"backbone_model.embed_tokens.embed_audio_tokens.weight": "depth_decoder.model.embed_tokens.weight"}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file, or the shards of its index)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: unreadable index: {exc}") from None
        files = sorted({folder / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    return [single]


def build_meta(config: CsmConfig) -> CsmTalker:
    """The model's parameters as meta tensors (shapes only, no memory)."""
    with torch.device("meta"):
        return CsmTalker(config)


def _expected(model: CsmTalker) -> dict[str, torch.Size]:
    shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    for alias in TIED:
        shapes.pop(alias, None)
    return shapes


def _read(files: list[Path], expected: dict[str, torch.Size], dtype: torch.dtype,
          device: torch.device | str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    unexpected, wrong = [], []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if key.startswith(CODEC_PREFIX):
                        continue
                    if key not in expected:
                        unexpected.append(key)
                        continue
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != tuple(expected[key]):
                        wrong.append(f"{key}: {shape} on disk, {tuple(expected[key])} expected")
                        continue
                    tensors[key] = f.get_tensor(key).to(dtype)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: cannot read safetensors: {exc}") from None
    missing = sorted(set(expected) - set(tensors))
    problems = []
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(sorted(unexpected))}")
    if wrong:
        problems.append(f"wrong shapes: {'; '.join(wrong)}")
    if problems:
        raise CheckpointError(f"{files[0].parent}: " + " | ".join(problems))
    return tensors


def load_talker(folder: str | Path, dtype: str | torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> CsmTalker:
    """Loads the talker from ``folder`` in ``dtype`` on ``device``, in eval mode."""
    folder = Path(folder)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    config = CsmConfig.from_folder(folder)
    model = build_meta(config)
    tensors = _read(weight_files(folder), _expected(model), dtype, device)
    for alias, stored in TIED.items():
        tensors[alias] = tensors[stored]
    model.load_state_dict(tensors, strict=True, assign=True)
    model.audio_offsets = (torch.arange(config.num_codebooks, dtype=torch.int64, device=device)
                           * config.audio_vocab_size)
    for module in model.modules():
        if isinstance(module, RotaryTable):
            module.materialize(device)
    return model.eval().requires_grad_(False)
