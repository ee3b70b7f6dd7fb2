"""A Qwen2.5-Omni talker request as prompt segments, and its packed host rows.

transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` feeds the talker (hidden states of
the thinker are zero here: the thinker is not run, so every input is a thinker *token embedding*):

* the prompt, one KV position each: the thinker's prompt tokens (the context), the speaker's
  text BOS (``speaker_params["bos_token"]``), the reply's first token; the codec PAD embedding is
  added at the BOS position and the codec BOS embedding at the last one. The prompt's codec ids are
  ``[MASK] * len(context) + [PAD, BOS]`` (``talker_input_ids``): only the last two are embedded,
  but the repetition penalty counts all of them;
* the reply stream: frame f's input is its code's embedding plus the embedding of reply token
  f + 1; after the reply comes the text EOS, then the text PAD for every later frame.

Segments: the **last** segment is the reply turn, ``[text_bos, r_0, r_1, ...]`` (the speaker's
BOS, then at least one token of the text to speak); the segments before it are the context (their
ids concatenated; none for a bare TTS request). This family has no audio-context turns.

Packed rows ``[L, 2]`` int64 (``TalkerModel.pack_prompt``; the engine's layout of codes in columns
0 .. N-1, text in column N, with N = 1): column 0 the codec id embedded at the position (-1 none:
the context and padding), column 1 the thinker token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from models.family import PromptSegment


@dataclass(frozen=True)
class TalkerPrompt:
    context: tuple[int, ...]   # the thinker's prompt tokens (MASK codec ids)
    text_bos: int              # the speaker's text BOS
    reply: tuple[int, ...]     # the text to speak, >= 1 token


def tts_segments(text_ids: Sequence[int], text_bos: int,
                 context_ids: Sequence[int] = ()) -> list[PromptSegment]:
    """A TTS request in this family's segment layout."""
    reply = PromptSegment([int(text_bos), *map(int, text_ids)])
    return [PromptSegment(list(map(int, context_ids))), reply] if len(context_ids) else [reply]


def split_segments(segments: Sequence[PromptSegment]) -> TalkerPrompt:
    """The request's parts; ValueError naming the segment when the layout is wrong."""
    if not segments:
        raise ValueError("segments: empty (the last segment is the reply turn [text_bos, text...])")
    context: list[int] = []
    for i, segment in enumerate(segments):
        if segment.frames is not None:
            raise ValueError(f"segments[{i}].frames: this family takes no audio-context turns")
        if i < len(segments) - 1:
            context.extend(int(t) for t in segment.text_token_ids)
    last = [int(t) for t in segments[-1].text_token_ids]
    if len(last) < 2:
        raise ValueError(f"segments[{len(segments) - 1}]: the reply turn needs the speaker's text BOS "
                         f"and at least one text token, got {len(last)} id(s)")
    return TalkerPrompt(tuple(context), last[0], tuple(last[1:]))


def pack_prompt(segments: Sequence[PromptSegment], codec_pad: int, codec_bos: int) -> np.ndarray:
    """The prompt's KV rows ``[len(context) + 2, 2]``: (codec id or -1, thinker token id)."""
    prompt = split_segments(segments)
    text = [*prompt.context, prompt.text_bos, prompt.reply[0]]
    rows = np.full((len(text), 2), -1, dtype=np.int64)
    rows[:, 1] = text
    rows[-2, 0], rows[-1, 0] = codec_pad, codec_bos
    return rows


def pack_reply(segments: Sequence[PromptSegment], text_eos: int) -> np.ndarray:
    """The reply stream ``[len(reply)]``: frame f's text id (reply token f + 1, then the text EOS);
    every later frame reads the text PAD (``QwenOmniCaches.reply``'s fill)."""
    prompt = split_segments(segments)
    return np.asarray([*prompt.reply[1:], text_eos], dtype=np.int64)


def prompt_codec_ids(segments: Sequence[PromptSegment], codec_mask: int, codec_pad: int,
                     codec_bos: int) -> list[int]:
    """transformers' ``talker_input_ids``: the prompt's codec ids (what the penalty counts)."""
    return [codec_mask] * len(split_segments(segments).context) + [codec_pad, codec_bos]
