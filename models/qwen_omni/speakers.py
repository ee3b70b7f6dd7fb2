"""The Qwen2.5-Omni family's voices, as Token2Wav reads them: per speaker the DiT's conditioning
vector ``cond`` and reference mel ``ref_mel``, and the speaker's text BOS id (the talker's).

A checkpoint folder holds them in ``spk_dict.safetensors`` (voxring's layout)::

    <name>.cond       float  (enc_emb_dim,) or (1, enc_emb_dim)
    <name>.ref_mel    float  (T_ref, mel_dim) or (1, T_ref, mel_dim)
    <name>.bos_token  int64  () or (1,): the speaker's text BOS id
    metadata "speakers": a JSON list of the names; a speaker's ``speaker_id`` is its index in it
    (the talker's ids, ``voxring.json``'s ``speaker_ids``, must agree: :func:`check_speaker_ids`)

A released Qwen2.5-Omni checkpoint ships its speakers as ``spk_dict.pt``, a torch pickle (``{name:
{"cond", "ref_mel", "bos_token", ...}}``). voxring loads no pickle: such a folder must be converted
to the layout above first (``torch.load`` once, in a trusted environment, then :func:`save_speakers`
with the names in the order the talker's ``speaker_id`` uses); until then loading names the file
to convert. The tiny default writes the file itself (models/qwen_omni/tiny_token2wav.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from models.checkpoint import CheckpointError

SPEAKERS_FILE = "spk_dict.safetensors"
PICKLED_FILE = "spk_dict.pt"


@dataclass(frozen=True)
class SpeakerVoice:
    speaker_id: int
    name: str
    cond: torch.Tensor      # (1, enc_emb_dim)
    ref_mel: torch.Tensor   # (1, T_ref, mel_dim)
    bos_token: int


def save_speakers(path: str | Path, speakers: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """Writes ``{name: (cond, ref_mel, bos_token)}`` in the layout above; ids follow the mapping's order."""
    tensors = {}
    for name, (cond, ref_mel, bos) in speakers.items():
        if "." in name or not name:
            raise ValueError(f"speaker name {name!r}: must be non-empty and hold no '.'")
        tensors[f"{name}.cond"] = cond.reshape(-1).float().contiguous()
        tensors[f"{name}.ref_mel"] = ref_mel.reshape(ref_mel.shape[-2:]).float().contiguous()
        tensors[f"{name}.bos_token"] = torch.tensor([int(bos)], dtype=torch.int64)
    # one metadata key: safetensors writes its metadata map in no fixed order (same input, other bytes)
    save_file(tensors, str(path), metadata={"speakers": json.dumps(list(speakers))})


def load_speakers(folder: str | Path, enc_emb_dim: int, mel_dim: int) -> list[SpeakerVoice]:
    """The folder's speakers by id (on the CPU, fp32); CheckpointError naming the file and key."""
    path = Path(folder) / SPEAKERS_FILE
    if not path.exists():
        pickled = Path(folder) / PICKLED_FILE
        hint = (f"; {pickled.name} is a torch pickle, which voxring does not load: convert it to "
                f"{SPEAKERS_FILE} (models/qwen_omni/speakers.py)") if pickled.exists() else ""
        raise CheckpointError(f"{path}: missing (the family's voices){hint}")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = json.loads((f.metadata() or {}).get("speakers", "null"))
            if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
                raise CheckpointError(f"{path}: metadata 'speakers' must be a JSON list of names")
            keys = set(f.keys())
            return [_speaker(f, keys, path, i, name, enc_emb_dim, mel_dim) for i, name in enumerate(names)]
    except (SafetensorError, OSError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path}: unreadable: {exc}") from None


def check_speaker_ids(folder: str | Path, speakers: list[SpeakerVoice]) -> None:
    """The talker numbers the speakers by ``voxring.json``'s ``speaker_ids`` (models/qwen_omni/
    loader.py ``prompt_info``), Code2Wav by this file's order: CheckpointError unless they agree
    (a folder without that map is numbered by this file alone)."""
    path = Path(folder) / "voxring.json"
    try:
        ids = json.loads(path.read_text(encoding="utf-8")).get("speaker_ids")
    except FileNotFoundError:
        return
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    ours = {s.name: s.speaker_id for s in speakers}
    if ids is not None and ids != ours:
        raise CheckpointError(f"{path}: speaker_ids {ids} differ from {SPEAKERS_FILE}'s order {ours}")


def _speaker(f, keys: set[str], path: Path, speaker_id: int, name: str, enc_emb_dim: int,
             mel_dim: int) -> SpeakerVoice:
    missing = [f"{name}.{part}" for part in ("cond", "ref_mel", "bos_token") if f"{name}.{part}" not in keys]
    if missing:
        raise CheckpointError(f"{path}: missing {', '.join(missing)}")
    cond = f.get_tensor(f"{name}.cond").float().reshape(1, -1)
    ref_mel = f.get_tensor(f"{name}.ref_mel").float()
    ref_mel = ref_mel.reshape(1, *ref_mel.shape[-2:]) if ref_mel.ndim >= 2 else ref_mel
    bos = f.get_tensor(f"{name}.bos_token").reshape(-1)
    if cond.shape[1] != enc_emb_dim:
        raise CheckpointError(f"{path}: {name}.cond has {cond.shape[1]} values, the DiT takes {enc_emb_dim}")
    if ref_mel.ndim != 3 or ref_mel.shape[2] != mel_dim or ref_mel.shape[1] < 1:
        raise CheckpointError(f"{path}: {name}.ref_mel must be (T_ref, {mel_dim}), "
                              f"got {tuple(ref_mel.shape)}")
    if bos.numel() != 1 or bos.is_floating_point():
        raise CheckpointError(f"{path}: {name}.bos_token must be one integer")
    return SpeakerVoice(speaker_id, name, cond, ref_mel, int(bos[0]))
