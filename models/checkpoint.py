"""Strict safetensors reading shared by the talker and codec loaders, and the device a
checkpoint loads onto.

A checkpoint folder holds ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. :func:`read_tensors` reads the keys under one prefix
(others belong to another stage's loader), checks every one against the model's
expected names and shapes, and reports all missing, unexpected and wrongly shaped keys
at once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from filelock import FileLock
from safetensors import SafetensorError, safe_open


class CheckpointError(ValueError):
    """A model checkpoint that cannot be loaded; the message names the cause. Raised at
    start-up (not a request error), so it is a ValueError, not a ServiceError."""


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def cache_dir() -> Path:
    """Where generated tiny checkpoints live: $VOXRING_CACHE_DIR, else $XDG_CACHE_HOME/voxring, else
    ~/.cache/voxring."""
    if os.environ.get("VOXRING_CACHE_DIR"):
        return Path(os.environ["VOXRING_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "voxring"


def ensure_generated(name: str, write: Callable[[Path], object], root: str | Path | None = None) -> Path:
    """The folder ``name`` under ``root`` (default: the cache's ``models/``), written by ``write`` on
    first use: under a file lock (safe across processes) into a temporary folder renamed into place,
    so readers see all of it or nothing."""
    models_dir = Path(root) if root is not None else cache_dir() / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    final = models_dir / name
    if final.is_dir():
        return final
    with FileLock(str(models_dir / f".{name}.lock"), timeout=300):
        if final.is_dir():  # another process finished it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=models_dir))
        try:
            write(tmp)
            os.chmod(tmp, 0o755)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when present, else the CPU; ``cuda`` without a GPU is a CheckpointError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError(f"{name!r} asked but no CUDA device is available")
    return torch.device(name)


def set_threads(threads: int) -> int:
    """Sets torch's intra-op CPU threads for this process (0: leaves torch's choice, which follows
    OMP_NUM_THREADS); returns the count in use, for the stage's start-up log."""
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def read_config_json(folder: str | Path) -> tuple[Path, dict]:
    """(path, parsed) of a checkpoint folder's config.json; CheckpointError naming the cause."""
    path = Path(folder) / "config.json"
    try:
        return path, json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a checkpoint folder?)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None


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


def read_tensors(folder: Path, expected: Mapping[str, torch.Size], dtype: torch.dtype,
                 device: torch.device | str, prefix: str = "",
                 skip_prefixes: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Reads the keys starting with ``prefix`` (returned without it), except those under
    ``skip_prefixes``; floating tensors are cast to ``dtype``. Strict against ``expected``."""
    tensors: dict[str, torch.Tensor] = {}
    unexpected, wrong = [], []
    files = weight_files(folder)
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not key.startswith(prefix) or key.startswith(skip_prefixes):
                        continue
                    name = key[len(prefix):]
                    if name not in expected:
                        unexpected.append(key)
                        continue
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != tuple(expected[name]):
                        wrong.append(f"{key}: {shape} on disk, {tuple(expected[name])} expected")
                        continue
                    tensor = f.get_tensor(key)
                    tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: cannot read safetensors: {exc}") from None
    problems = []
    missing = sorted(prefix + name for name in set(expected) - set(tensors))
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(sorted(unexpected))}")
    if wrong:
        problems.append(f"wrong shapes: {'; '.join(wrong)}")
    if problems:
        raise CheckpointError(f"{folder}: " + " | ".join(problems))
    return tensors
