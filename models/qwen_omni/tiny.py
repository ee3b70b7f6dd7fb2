"""``voxring-tiny-qwen-omni``: a tiny Qwen2.5-Omni talker checkpoint, generated locally and
deterministically (nothing is downloaded; the same seed gives byte-identical files; untrained).

The layout of a real Qwen2.5-Omni checkpoint, cut down to the talker's part: ``config.json`` (a
``Qwen2_5OmniConfig`` in transformers' field names, the ``thinker_config`` reduced to the text sizes the
talker reads) and ``model.safetensors`` with the ``talker.*`` keys and ``thinker.model.embed_tokens.weight``.
Token2Wav's part is in it too (models/qwen_omni/tiny_token2wav.py): ``token2wav_config``, the
``token2wav.*`` weights, and the speakers' voices in ``spk_dict.safetensors`` (models/qwen_omni/
speakers.py; a speaker's id is its index in ``SPEAKERS``, as ``SPEAKER_IDS``).
Thinker ids: 0..255 bytes, then the TTS text specials and two speakers' text BOS ids (``SPEAKERS``);
codec ids: 64 codes, then the codec specials, laid out as Qwen2.5-Omni-7B's (codes, then PAD / BOS /
EOS / MASK above them).

Its ``tokenizer.json`` (the ``tokenizers`` library) maps byte b to thinker id b and has one special
token per thinker special: ``<|tts_pad|>`` / ``<|tts_bos|>`` / ``<|tts_eos|>`` and ``<|spk0|>``,
``<|spk1|>``, ... (the speakers' text BOS ids, in ``SPEAKERS``' order). ``voxring.json`` gives the
prompt format clients fill in, ``PROMPT_FORMAT`` (``<|spk{speaker}|>{text}``: the reply turn
``[speaker's text BOS, text bytes...]`` that models/qwen_omni/prompt.py reads as the last segment),
and the speakers' ids for ``{speaker}`` (``SPEAKER_IDS``).

:func:`ensure_tiny_checkpoint` creates it on first use in the cache folder, under a file lock, writing
into a temporary folder that is renamed into place (as models/tiny/talker.py does for voxring-tiny).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from models.checkpoint import ensure_generated
from models.qwen_omni.speakers import SPEAKERS_FILE, save_speakers
from models.qwen_omni.tiny_token2wav import tiny_speakers, tiny_token2wav_config, tiny_token2wav_weights

GENERATOR_VERSION = 3
NAME = "voxring-tiny-qwen-omni"
TEXT_PAD, TEXT_BOS, TEXT_EOS = 256, 257, 258
SPEAKERS = {"Chelsie": 259, "Ethan": 260}  # each speaker's text BOS (spk_dict.pt's "bos_token")
SPEAKER_IDS = {name: i for i, name in enumerate(SPEAKERS)}  # what replaces {speaker}
PROMPT_FORMAT = "<|spk{speaker}|>{text}"
TEXT_SPECIALS = {"<|tts_pad|>": TEXT_PAD, "<|tts_bos|>": TEXT_BOS, "<|tts_eos|>": TEXT_EOS,
                 **{f"<|spk{SPEAKER_IDS[name]}|>": bos for name, bos in SPEAKERS.items()}}
THINKER_VOCAB = 264
NUM_CODES = 64
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 72, 73, 74, 76
CODEC_VOCAB = 80


def tiny_config() -> dict:
    """config.json of the tiny checkpoint."""
    talker = {
        "model_type": "qwen2_5_omni_talker", "vocab_size": CODEC_VOCAB, "embedding_size": 64,
        "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2]},
        "tts_codec_start_token_id": CODEC_BOS, "tts_codec_end_token_id": CODEC_EOS,
        "tts_codec_pad_token_id": CODEC_PAD, "tts_codec_mask_token_id": CODEC_MASK,
        "tts_text_start_token_id": TEXT_BOS, "tts_text_end_token_id": TEXT_EOS,
        "tts_text_pad_token_id": TEXT_PAD, "dtype": "float32",
    }
    thinker = {"model_type": "qwen2_5_omni_thinker",
               "text_config": {"model_type": "qwen2_5_omni_text", "vocab_size": THINKER_VOCAB,
                               "hidden_size": 64}}
    return {"architectures": ["Qwen2_5OmniForConditionalGeneration"], "model_type": "qwen2_5_omni",
            "enable_audio_output": True, "thinker_config": thinker, "talker_config": talker,
            "token2wav_config": tiny_token2wav_config(NUM_CODES), "dtype": "float32"}


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet's character for each byte (GPT-2's table, as ``ByteLevel`` uses)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer() -> Tokenizer:
    """Byte-level: byte b is thinker id b, then the thinker's specials (``TEXT_SPECIALS``) at their
    ids; nothing is added around an encoded text (the prompt format holds the specials)."""
    chars = _bytes_to_unicode()
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = sorted(TEXT_SPECIALS.items(), key=lambda item: item[1])
    assert [i for _, i in specials] == list(range(256, 256 + len(specials)))  # added in id order
    tokenizer.add_special_tokens([name for name, _ in specials])
    return tokenizer


def tiny_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights for every tensor the talker reads (on-disk names), on the CPU in fp32."""
    from models.qwen_omni.config import QwenOmniTalkerConfig
    from models.qwen_omni.loader import build_meta, expected_shapes

    shapes = expected_shapes(build_meta(QwenOmniTalkerConfig.from_dict(config)))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            tensor = 0.1 * noise
        elif "embed_tokens" in name:
            tensor = noise
        else:
            tensor = noise / shape[-1] ** 0.5
        tensors[name] = tensor.contiguous()
    return tensors


def write_tiny_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """Writes the tiny checkpoint into ``folder`` (created). Same seed, same bytes."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = {**tiny_weights(config, seed), **tiny_token2wav_weights(config["token2wav_config"], seed)}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_speakers(folder / SPEAKERS_FILE, tiny_speakers(config["token2wav_config"], SPEAKERS, seed))
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "voxring.json").write_text(json.dumps(
        {"name": NAME, "generator_version": GENERATOR_VERSION, "seed": seed, "speakers": SPEAKERS,
         "prompt_format": PROMPT_FORMAT, "speaker_ids": SPEAKER_IDS}, indent=2, sort_keys=True) + "\n")
    return folder


def ensure_tiny_checkpoint(seed: int = 0, root: str | Path | None = None) -> Path:
    """The tiny folder for ``seed``, created on first use (safe across processes)."""
    return ensure_generated(f"{NAME}-v{GENERATOR_VERSION}-seed{seed}",
                            lambda folder: write_tiny_checkpoint(folder, seed), root)
