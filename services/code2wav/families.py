"""Which decoder Code2Wav serves: the model family of its checkpoint.

``model.checkpoint`` names a folder, a family's tiny default (``tiny:csm``, ``tiny:qwen-omni``,
models/tiny/talker.py ``checkpoint_folder``, the talker's resolution too, so both stages of a
pair load the same checkpoint), or nothing (voxring-tiny). The folder's config.json names the
family:

* ``qwen2_5_omni`` (Qwen2.5-Omni): Token2Wav streamed (services/code2wav/token2wav_decoder.py),
  its ``token2wav.*`` weights, its speakers from ``spk_dict.safetensors`` (models/qwen_omni/
  speakers.py: a released checkpoint's ``spk_dict.pt`` pickle must be converted first), the
  talker's codec vocabulary as the code space (its special codes dropped). The window is
  models/qwen_omni/window.py's default (C = 2, L = 2, A = 1 blocks), the solver the released
  model's (10 RK4 steps, guidance 0.5, sway -1); on CUDA its DiT solve and steady vocoder
  call replay graphs per row bucket within the engine section's graph budget;
* anything else: the Mimi codec of a CSM checkpoint (services/code2wav/decoder.py), with its
  CUDA graphs as the engine section says.

Every problem is a CheckpointError; the stage reports it as a config error naming
``model.checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.mimi.loader import load_codec
from models.qwen_omni.config import QwenOmniTalkerConfig
from models.qwen_omni.loader import is_qwen_omni_folder
from models.qwen_omni.speakers import check_speaker_ids, load_speakers
from models.qwen_omni.token2wav import load_token2wav
from models.tiny.talker import checkpoint_folder
from services.code2wav.decoder import CodecDecoder
from services.code2wav.decoding import Decoder
from services.code2wav.token2wav_decoder import FAMILY, GraphBudget, Token2WavDecoder


def load_decoder(model, engine, device: torch.device) -> tuple[Decoder, Path, str]:
    """(the decoder, its checkpoint folder, the family's name) for the ``model`` and ``engine``
    config sections."""
    folder = checkpoint_folder(model)
    if is_qwen_omni_folder(folder):
        return token2wav_decoder(folder, model.dtype, device, engine), folder, FAMILY
    codec = load_codec(folder, model.dtype, device)
    decoder = CodecDecoder(codec, engine.max_slots, buckets=engine.graph_buckets,
                           chunk_frames=engine.graph_chunk_frames,
                           max_graphs=engine.max_graphs if engine.cuda_graphs else 0,
                           max_graph_mb=engine.max_graph_mb, deterministic=engine.deterministic)
    return decoder, folder, "csm"


def token2wav_decoder(folder: Path, dtype: str, device: torch.device, engine) -> Token2WavDecoder:
    """The Qwen2.5-Omni family's streaming decoder from a checkpoint folder, its rows and graphs
    as the ``engine`` section says."""
    model = load_token2wav(folder, dtype, device)
    dit = model.config.dit
    speakers = load_speakers(folder, dit.enc_emb_dim, dit.mel_dim)
    check_speaker_ids(folder, speakers)  # the ids the talker's prompt format uses
    talker = QwenOmniTalkerConfig.from_folder(folder)
    graphs = GraphBudget(engine.graph_buckets, engine.max_graphs if engine.cuda_graphs else 0,
                         engine.max_graph_mb)
    return Token2WavDecoder(model, speakers, engine.max_slots, code_space=talker.vocab_size, graphs=graphs,
                            deterministic=engine.deterministic)


__all__ = ["load_decoder", "token2wav_decoder"]
