"""The Qwen2.5-Omni talker as a voxring talker family: one codec token a frame, one codebook.

Parameter names are the on-disk Qwen2.5-Omni layout (transformers' ``Qwen2_5OmniForConditionalGeneration``
keys ``talker.*`` and ``thinker.model.embed_tokens.weight``), so checkpoints load by name. Inputs are
summed in the thinker's width E and projected to the talker's H by ``talker.thinker_to_talker_proj``
(``Qwen2_5OmniTalkerForConditionalGeneration.forward``: ``talker_lm_input = thinker_to_talker_proj(
inputs_embeds)``); ``talker.codec_head`` gives the logits from the final-normed hidden state.

The request (prompt.py): the prompt's KV rows (context tokens, speaker text BOS + codec PAD, first reply
token + codec BOS), then one frame a step. One frame, from the last hidden state h:

  1. logits = ``codec_head(h)``; the codec BOS is suppressed (transformers ``suppress_tokens=[codec_bos]``),
     and while f < ``min_frames`` both end ids are too (transformers' ``min_new_tokens``);
  2. the code is sampled by voxring's sampler over all V ids, its repetition penalty counting the row's
     window of codes **and the prompt's codec ids** (MASK if the prompt had context, PAD, BOS: they are
     in transformers' ``input_ids``, which its ``RepetitionPenaltyLogitsProcessor`` reads whole);
  3. stop: the code is either end id (``eos_token_id=[codec_pad, codec_eos]``), at f >= min_frames; the
     stop frame is not audio;
  4. the next input: ``proj(codec_embed(code) + thinker_embed(reply_stream[f]))`` (transformers:
     ``codec_embeds + thinker_reply_part[:, :1, :]``), written at the row's position; its hidden state
     is the next h. The reply stream (``QwenOmniCaches.reply``, per slot, written by ``write_reply``)
     holds reply tokens 1.., then the text EOS; every later frame reads the text PAD.

No host sync, no branch on tensor values and static shapes in ``decode_frame``, as the protocol asks.

Two things differ from CSM's frame: ``min_frames`` bans the end ids' logits (transformers' rule) rather
than ignoring a stop frame, since an end id is no audio; and the reply stream is per-request state beyond
the packed prompt: it is the family's slot state (``TalkerModel.pack_slot_state`` = ``pack_reply``,
``write_slot_state``), which the engine writes with the prompt's final prefill chunk (direct callers use
``write_reply``; a slot without it reads the text PAD from its first frame).

Its prompts take no audio-context turns (``audio_context`` false): a session's next segment is a fresh
prompt in the same slot, the earlier segments' text its context (services/talker/sessions.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kernels.sampler import sample  # the Triton kernel on CUDA where it takes V, its eager twin otherwise
from models.csm.modules import KVCache
from models.family import FrameInputs, FrameOutputs, PromptSegment
from models.qwen_omni import prompt as layout
from models.qwen_omni.config import QwenOmniTalkerConfig
from models.qwen_omni.talker_layers import TalkerStack

_NEG_INF = float("-inf")


class _ThinkerModel(nn.Module):
    def __init__(self, config: QwenOmniTalkerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.thinker_vocab_size, config.embedding_size)


class ThinkerEmbeddings(nn.Module):
    """The one thinker tensor the talker reads: ``thinker.model.embed_tokens``."""

    def __init__(self, config: QwenOmniTalkerConfig) -> None:
        super().__init__()
        self.model = _ThinkerModel(config)


class TalkerNet(nn.Module):
    """``Qwen2_5OmniTalkerForConditionalGeneration``'s parameters."""

    def __init__(self, config: QwenOmniTalkerConfig) -> None:
        super().__init__()
        self.thinker_to_talker_proj = nn.Linear(config.embedding_size, config.hidden_size, bias=True)
        self.model = TalkerStack(config)
        self.codec_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


@dataclass
class QwenOmniCaches:
    kv: KVCache          # [L, num_slots, max_len, Hkv, D]
    reply: torch.Tensor  # [num_slots, max_len + 1] int64: frame f's text id; the last column stays PAD


class QwenOmniTalker(nn.Module):
    rows_per_request = 1
    num_codebooks = 1
    audio_context = False

    def __init__(self, config: QwenOmniTalkerConfig) -> None:
        super().__init__()
        self.config = config
        self.codebook_size = config.vocab_size  # the sampler's ids: transformers suppresses only the BOS
        self.text_vocab_size = config.thinker_vocab_size
        self.hidden_size = config.hidden_size
        self.max_len = config.max_len
        self.frame_rate = config.frame_rate
        self.sample_rate = config.sample_rate
        self.talker = TalkerNet(config)
        self.thinker = ThinkerEmbeddings(config)

    # --- prompt and prefill -------------------------------------------------------------

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.talker.model.embed_tokens(ids)

    def text_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.thinker.model.embed_tokens(ids)

    def prompt_embeds(self, segments: Sequence[PromptSegment]) -> torch.Tensor:
        """The prompt [L, H] as transformers builds it: thinker embeddings of context + [text BOS,
        reply[0]], the codec PAD / BOS embeddings added at the last two positions, projected."""
        cfg, device = self.config, self.talker.codec_head.weight.device
        request = layout.split_segments(segments)
        ids = torch.tensor([*request.context, request.text_bos, request.reply[0]], device=device)
        embeds = self.text_embed(ids).clone()
        specials = torch.tensor([cfg.codec_pad_token_id, cfg.codec_bos_token_id], device=device)
        embeds[-2:] += self.codec_embed(specials)
        return self.talker.thinker_to_talker_proj(embeds)

    def pack_prompt(self, segments: Sequence[PromptSegment]) -> np.ndarray:
        return layout.pack_prompt(segments, self.config.codec_pad_token_id, self.config.codec_bos_token_id)

    def pack_reply(self, segments: Sequence[PromptSegment]) -> np.ndarray:
        """The request's reply stream [R] (``write_reply`` takes it); host code, like ``pack_prompt``."""
        return layout.pack_reply(segments, self.config.text_eos_token_id)

    def embed_packed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Packed rows [..., T, 2] -> [..., T, H], equal to ``prompt_embeds``; branch-free (both tables
        read at every position, the codec one zeroed where column 0 is -1)."""
        codec, text = tokens[..., 0], tokens[..., 1]
        embeds = self.text_embed(text.clamp(min=0))
        codec_part = self.codec_embed(codec.clamp(min=0)).masked_fill((codec < 0)[..., None], 0.0)
        return self.talker.thinker_to_talker_proj(embeds + codec_part)

    def new_caches(self, num_slots: int, max_len: int, batch_size: int) -> QwenOmniCaches:
        device = self.talker.codec_head.weight.device
        reply = torch.full((num_slots, max_len + 1), self.config.text_pad_token_id, dtype=torch.int64,
                           device=device)
        return QwenOmniCaches(self.talker.model.new_cache(num_slots, max_len), reply)

    def pack_slot_state(self, segments: Sequence[PromptSegment]) -> np.ndarray:
        """The family's slot state is the reply stream (``TalkerModel.pack_slot_state``)."""
        return self.pack_reply(segments)

    def write_slot_state(self, caches: QwenOmniCaches, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Sets the reply stream of ``slots`` [R] from ``states`` [R, S] (``pack_reply`` rows right-padded
        with -1, on the device): the padding and every column past S read the text PAD. Columns past the
        cache's frames are never read (a slot has no more frames) and are dropped. Device work only."""
        pad = self.config.text_pad_token_id
        states = states[:, : caches.reply.shape[1] - 1]
        values = torch.where(states < 0, pad, states)
        caches.reply.index_fill_(0, slots, pad)
        cols = torch.arange(values.shape[1], device=values.device)
        caches.reply[slots[:, None], cols[None, :]] = values

    def write_reply(self, caches: QwenOmniCaches, slots: torch.Tensor, streams: Sequence[np.ndarray]) -> None:
        """Sets the reply stream of each slot (``pack_reply``'s arrays, one per slot) through
        ``write_slot_state``: one host-to-device copy, no sync. Every later frame of the slot reads
        the text PAD."""
        width = caches.reply.shape[1] - 1
        longest = max((len(s) for s in streams), default=0)
        if longest > width:
            raise ValueError(f"streams: a reply stream of {longest} ids exceeds the cache's {width} frames")
        host = np.full((len(streams), max(longest, 1)), -1, dtype=np.int64)
        for row, stream in enumerate(streams):
            host[row, : len(stream)] = stream
        values = torch.from_numpy(host).to(caches.reply.device, non_blocking=True)
        self.write_slot_state(caches, slots, values)

    def prefill(self, embeds: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                caches: QwenOmniCaches, starts: torch.Tensor | None = None) -> torch.Tensor:
        # embeds: [B, T, H] right-padded, projected; lengths, slots, starts: [B] -> last hidden [B, H]
        b, t, _ = embeds.shape
        positions = torch.arange(t, device=embeds.device).expand(b, t)
        if starts is not None:
            positions = positions + starts[:, None]
        hidden = self.talker.model(embeds, caches.kv, slots, positions.clamp(max=caches.kv.max_len - 1))
        # Padding positions wrote K/V past a row's end; its next chunk or frame rewrites them first.
        return hidden[torch.arange(b, device=embeds.device), lengths - 1]

    # --- one frame ------------------------------------------------------------------------

    def masked_logits(self, logits: torch.Tensor, inputs: FrameInputs) -> torch.Tensor:
        """[B, V] fp32 with the codec BOS at -inf, and both end ids too while f < min_frames."""
        cfg = self.config
        ids = torch.arange(logits.shape[-1], device=logits.device)
        is_end = (ids == cfg.codec_pad_token_id) | (ids == cfg.codec_eos_token_id)       # [V]
        early = (inputs.frame_index < inputs.min_frames)[:, None]                           # [B, 1]
        banned = (ids == cfg.codec_bos_token_id)[None, :] | (early & is_end[None, :])       # [B, V]
        return torch.where(banned, _NEG_INF, logits.float())

    def penalty_history(self, inputs: FrameInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler's history [B, W + 3] and windows [B]: the row's codes, then the prompt's codec
        ids (MASK when the prompt had context positions, -1 otherwise; PAD; BOS), counted whenever
        the row's window is on. A row's prompt length is ``positions - frame_index`` (2: no context)."""
        cfg = self.config
        prompt_len = inputs.positions - inputs.frame_index
        mask_id = torch.where(prompt_len > 2, cfg.codec_mask_token_id, -1)                  # [B]
        fixed = torch.stack([mask_id, torch.full_like(mask_id, cfg.codec_pad_token_id),
                             torch.full_like(mask_id, cfg.codec_bos_token_id)], dim=1)     # [B, 3]
        history = torch.cat([inputs.history[:, 0], fixed], dim=1)
        window = inputs.sampling.repetition_window
        return history, torch.where(window > 0, window + fixed.shape[1], 0)

    def pick(self, logits: torch.Tensor, inputs: FrameInputs) -> torch.Tensor:
        """The frame's code [B] from the raw logits [B, V]."""
        history, window = self.penalty_history(inputs)
        params = dataclasses.replace(inputs.sampling, repetition_window=window)
        return sample(self.masked_logits(logits, inputs), params, inputs.frame_index, 0, history,
                      self.codebook_size)

    def step_codes(self, codes: torch.Tensor, inputs: FrameInputs, caches: QwenOmniCaches) -> torch.Tensor:
        """Advances each row by its frame's code [B] (teacher forcing calls it with given codes):
        writes the input at ``inputs.positions`` -> the next hidden state [B, H]."""
        reply = caches.reply
        column = inputs.frame_index.clamp(min=0, max=reply.shape[1] - 1)
        text_ids = reply[inputs.slots, column]                                              # [B]
        embeds = self.codec_embed(codes) + self.text_embed(text_ids)                        # [B, E]
        x = self.talker.thinker_to_talker_proj(embeds)[:, None]                             # [B, 1, H]
        return self.talker.model(x, caches.kv, inputs.slots, inputs.positions[:, None])[:, 0]

    def is_stop(self, codes: torch.Tensor, inputs: FrameInputs) -> torch.Tensor:
        cfg = self.config
        end = (codes == cfg.codec_pad_token_id) | (codes == cfg.codec_eos_token_id)
        return end & (inputs.frame_index >= inputs.min_frames)

    def decode_frame(self, inputs: FrameInputs, caches: QwenOmniCaches,
                     return_logits: bool = False) -> FrameOutputs:
        logits = self.talker.codec_head(inputs.hidden).float()                              # [B, V]
        code = self.pick(logits, inputs)                                                    # [B]
        hidden = self.step_codes(code, inputs, caches)
        history = inputs.history
        if history.shape[-1] > 0:
            history = torch.cat([history[:, :, 1:], code[:, None, None]], dim=-1)
        return FrameOutputs(codes=code[:, None], stop=self.is_stop(code, inputs), hidden=hidden,
                            history=history, logits=logits[:, None] if return_logits else None)
