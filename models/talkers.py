"""Which talker family a checkpoint folder holds, and that family's loader and prompt facts.

A stage picks the family from the folder's ``config.json``: ``model_type`` ``qwen2_5_omni`` is the
Qwen2.5-Omni family (models/qwen_omni/), anything else is read as CSM (models/csm/; its loader names a
wrong ``model_type``). The engine then talks to the model only through ``models/family.py``'s
``TalkerModel``; the family's name goes to clients in ``ModelInfoResponse.family``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from models.csm import loader as csm_loader
from models.family import PromptInfo, TalkerModel
from models.qwen_omni import loader as qwen_omni_loader


@dataclass(frozen=True)
class Family:
    name: str                                       # "csm", "qwen_omni"
    load: Callable[..., TalkerModel]                # (folder, dtype, device) -> the model, in eval mode
    prompt_info: Callable[[Path], PromptInfo]       # the folder's turn format and speakers


FAMILIES = {
    "csm": Family("csm", csm_loader.load_talker, csm_loader.prompt_info),
    "qwen_omni": Family("qwen_omni", qwen_omni_loader.load_talker, qwen_omni_loader.prompt_info),
}


def family_of(folder: str | Path) -> Family:
    """The family of a checkpoint folder; CheckpointError when its config.json is missing or unreadable."""
    return FAMILIES["qwen_omni" if qwen_omni_loader.is_qwen_omni_folder(folder) else "csm"]
