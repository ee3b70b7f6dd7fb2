"""The Qwen2.5-Omni talker's configuration, read from a checkpoint folder's ``config.json``.

The folder holds a whole Qwen2.5-Omni checkpoint (``model_type`` ``qwen2_5_omni``, transformers'
``Qwen2_5OmniConfig``): the talker's fields come from ``talker_config``; the thinker's token
table (the talker reads ``thinker.model.embed_tokens``) is sized by ``thinker_config.text_config``;
the token rate comes from ``token2wav_config`` (its own classes belong to the token-to-wave side:
only the two numbers that fix the rate are read here). Both rotary spellings real configs use
are accepted: transformers 5's ``rope_parameters`` and 4.x's ``rope_scaling`` + ``rope_theta``.
Missing or unsupported fields are errors that name the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.checkpoint import CheckpointError, read_config_json

__all__ = ["CheckpointError", "QwenOmniTalkerConfig", "is_qwen_omni"]

MODEL_TYPE = "qwen2_5_omni"
SAMPLE_RATE = 24000  # the token-to-wave side's output rate (BigVGAN at 24 kHz)
# transformers' defaults for the token-to-wave rate: DiT repeats each code twice into mel frames,
# BigVGAN upsamples a mel frame by 5*3*2*2*2*2 = 240 samples: 24000 / (2 * 240) = 50 codes a second
DEFAULT_DIT_REPEATS = 2
DEFAULT_UPSAMPLE_RATES = (5, 3, 2, 2, 2, 2)


def is_qwen_omni(raw: dict[str, Any]) -> bool:
    """Whether a parsed config.json is a Qwen2.5-Omni checkpoint (this family's loader takes it)."""
    return raw.get("model_type") == MODEL_TYPE


@dataclass(frozen=True)
class QwenOmniTalkerConfig:
    """The talker (transformers' ``Qwen2_5OmniTalkerForConditionalGeneration``) and what it reads."""

    embedding_size: int        # E: the thinker's hidden size; inputs are summed here, then projected
    hidden_size: int           # H: the talker's decoder width
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]  # frequencies per position stream (temporal, height, width)
    vocab_size: int            # V: the codec vocabulary (codes and the codec specials)
    thinker_vocab_size: int    # rows of thinker.model.embed_tokens
    codec_bos_token_id: int    # tts_codec_start_token_id: suppressed, never sampled
    codec_eos_token_id: int    # tts_codec_end_token_id: an end id
    codec_pad_token_id: int    # tts_codec_pad_token_id: the other end id
    codec_mask_token_id: int   # tts_codec_mask_token_id: the prompt's codec id at context positions
    text_bos_token_id: int     # tts_text_start_token_id: the default speaker's text BOS
    text_eos_token_id: int     # tts_text_end_token_id: follows the reply text
    text_pad_token_id: int     # tts_text_pad_token_id: fed once the reply text is spent
    codec_codebook_size: int   # codes the token-to-wave side embeds (DiT num_embeds)
    sample_rate: int
    frame_rate: float

    @property
    def max_len(self) -> int:
        return self.max_position_embeddings

    @property
    def end_token_ids(self) -> tuple[int, int]:
        """The ids that end a request: transformers' talker ``eos_token_id=[pad, end]``."""
        return (self.codec_pad_token_id, self.codec_eos_token_id)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> QwenOmniTalkerConfig:
        if not is_qwen_omni(raw):
            raise CheckpointError(f"{where}: model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        talker = _section(raw, "talker_config", where)
        thinker = _section(raw, "thinker_config", where)
        text = thinker.get("text_config") if isinstance(thinker.get("text_config"), dict) else thinker
        tw = f"{where}: talker_config"
        _check_supported(talker, tw)
        hidden, heads = _int(talker, "hidden_size", tw), _int(talker, "num_attention_heads", tw)
        kv_heads = talker.get("num_key_value_heads") or heads
        head_dim = talker.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise CheckpointError(f"{tw}: num_attention_heads ({heads}) is not a multiple of "
                                  f"num_key_value_heads ({kv_heads})")
        theta, section = _rope(talker, int(head_dim), tw)
        embedding = _int(talker, "embedding_size", tw)
        thinker_hidden = _int(text, "hidden_size", f"{where}: thinker_config.text_config")
        if thinker_hidden != embedding:
            raise CheckpointError(f"{tw}: embedding_size {embedding} differs from the thinker's "
                                  f"hidden_size {thinker_hidden}")
        vocab = _int(talker, "vocab_size", tw)
        ids = {key: _id(talker, key, kind, tw) for key, kind in _TOKEN_FIELDS.items()}
        thinker_vocab = _int(text, "vocab_size", f"{where}: thinker_config.text_config")
        for key, value in ids.items():
            limit = vocab if _TOKEN_FIELDS[key] == "codec" else thinker_vocab
            if not 0 <= value < limit:
                raise CheckpointError(f"{tw}: {key} {value} is outside [0, {limit})")
        repeats, rates, num_embeds = _token2wav(raw, where)
        return cls(
            embedding_size=embedding, hidden_size=hidden,
            intermediate_size=_int(talker, "intermediate_size", tw),
            num_layers=_int(talker, "num_hidden_layers", tw), num_heads=heads,
            num_kv_heads=int(kv_heads), head_dim=int(head_dim),
            max_position_embeddings=_int(talker, "max_position_embeddings", tw),
            rms_norm_eps=float(talker.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            mrope_section=section, vocab_size=vocab, thinker_vocab_size=thinker_vocab,
            codec_bos_token_id=ids["tts_codec_start_token_id"],
            codec_eos_token_id=ids["tts_codec_end_token_id"],
            codec_pad_token_id=ids["tts_codec_pad_token_id"],
            codec_mask_token_id=ids["tts_codec_mask_token_id"],
            text_bos_token_id=ids["tts_text_start_token_id"],
            text_eos_token_id=ids["tts_text_end_token_id"],
            text_pad_token_id=ids["tts_text_pad_token_id"],
            codec_codebook_size=num_embeds, sample_rate=SAMPLE_RATE,
            frame_rate=SAMPLE_RATE / (repeats * math.prod(rates)))

    @classmethod
    def from_folder(cls, folder: str | Path) -> QwenOmniTalkerConfig:
        path, raw = read_config_json(folder)
        return cls.from_dict(raw, str(path))


# the special ids and which vocabulary each indexes (transformers' Qwen2_5OmniTalkerConfig defaults
# are those of Qwen2.5-Omni-7B: codec 8293/8294/8292/8296 of 8448, text 151860/151861/151859)
_TOKEN_FIELDS = {
    "tts_codec_start_token_id": "codec", "tts_codec_end_token_id": "codec",
    "tts_codec_pad_token_id": "codec", "tts_codec_mask_token_id": "codec",
    "tts_text_start_token_id": "text", "tts_text_end_token_id": "text", "tts_text_pad_token_id": "text",
}
_DEFAULT_IDS = {
    "tts_codec_start_token_id": 8293, "tts_codec_end_token_id": 8294, "tts_codec_pad_token_id": 8292,
    "tts_codec_mask_token_id": 8296, "tts_text_start_token_id": 151860,
    "tts_text_end_token_id": 151861, "tts_text_pad_token_id": 151859,
}


def _check_supported(talker: dict[str, Any], where: str) -> None:
    if talker.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {talker['hidden_act']!r} is not supported (silu)")
    if talker.get("use_sliding_window"):
        raise CheckpointError(f"{where}: use_sliding_window=true is not supported")


def _rope(talker: dict[str, Any], head_dim: int, where: str) -> tuple[float, tuple[int, int, int]]:
    """(theta, mrope_section) from ``rope_parameters`` or ``rope_scaling`` + ``rope_theta``."""
    params = talker.get("rope_parameters")
    if params is None:
        params = dict(talker.get("rope_scaling") or {})
        params.setdefault("rope_theta", talker.get("rope_theta", 1000000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"{where}: rope type {rope_type!r} is not supported (default M-RoPE)")
    if "rope_theta" not in params:
        raise CheckpointError(f"{where}: rope_theta is missing (in rope_parameters or top level)")
    section = tuple(int(s) for s in params.get("mrope_section", (16, 24, 24)))  # transformers' default
    if len(section) != 3 or min(section) < 0 or sum(section) != head_dim // 2:
        raise CheckpointError(f"{where}: mrope_section {list(section)} must be 3 sizes summing to "
                              f"head_dim / 2 = {head_dim // 2}")
    return float(params["rope_theta"]), section  # type: ignore[return-value]


def _token2wav(raw: dict[str, Any], where: str) -> tuple[int, tuple[int, ...], int]:
    """(DiT repeats, BigVGAN upsample rates, DiT num_embeds), transformers' defaults where absent."""
    section = raw.get("token2wav_config") or {}
    dit = section.get("dit_config") or {}
    bigvgan = section.get("bigvgan_config") or {}
    repeats = dit.get("repeats", DEFAULT_DIT_REPEATS)
    rates = tuple(bigvgan.get("upsample_rates", DEFAULT_UPSAMPLE_RATES))
    if not isinstance(repeats, int) or repeats < 1 or not rates or min(rates) < 1:
        raise CheckpointError(f"{where}: token2wav_config: dit repeats / bigvgan upsample_rates invalid")
    return repeats, rates, int(dit.get("num_embeds", 8193))


def _section(raw: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: {key} is missing")
    return value


def _id(raw: dict[str, Any], key: str, kind: str, where: str) -> int:
    value = raw.get(key, _DEFAULT_IDS[key])
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{where}: {key} must be an integer ({kind} id), got {value!r}")
    return value


def _int(raw: dict[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value
