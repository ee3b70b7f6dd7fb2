"""The interface between the talker engine and a model family.

The engine (scheduler, runner, rings) talks to a talker model only through this
interface, so other families (a single-codebook talker with an EOS code, a backbone
with a local transformer and a continue/stop head, a Qwen3 backbone with CFG pairs)
can be added without touching the engine. Every method works on batches of rows whose
state lives in static KV slots, and ``decode_frame`` is one whole frame as docs/architecture.md's
"one captured frame": no host sync, no Python branches on tensor values, static shapes,
so the runner can capture it in a CUDA graph.

Per-request state a family keeps beyond the KV cache (the Qwen2.5-Omni talker's reply stream:
the text token each frame reads) goes through ``pack_slot_state`` / ``write_slot_state``: packed on
the host with the prompt, written into the caches when the prompt's last chunk is prefilled, read
there by ``decode_frame`` (so a captured frame sees it). A family without any (CSM) returns None
and its write is never called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kernels.sampler_twin import SamplingParams


@dataclass(frozen=True)
class PromptSegment:
    """One prompt turn: text token ids (already with the family's special tokens),
    then, for an audio-context turn, its codec frames ``[num_frames, num_codebooks]``."""

    text_token_ids: Sequence[int]
    frames: torch.Tensor | None = None


@dataclass
class FrameInputs:
    """Everything one frame step reads, per row. All tensors on the model's device."""

    hidden: torch.Tensor        # [B, H] the backbone's last hidden state (after its norm)
    slots: torch.Tensor         # [B] int64 KV slot of each row
    positions: torch.Tensor     # [B] int64 position the frame's embedding is written at
    frame_index: torch.Tensor   # [B] int64 generated-frame index f (0 = first frame)
    min_frames: torch.Tensor    # [B] int64 the stop rule is ignored while f < min_frames
    sampling: SamplingParams    # per-row sampling parameters
    history: torch.Tensor       # [B, num_codebooks, W] int64 recent codes (-1 empty), oldest first


@dataclass
class FrameOutputs:
    codes: torch.Tensor         # [B, num_codebooks] int64 the frame
    stop: torch.Tensor          # [B] bool this frame is the stop frame (not audio; ends the row)
    hidden: torch.Tensor        # [B, H] the next frame's input hidden state
    history: torch.Tensor       # [B, num_codebooks, W] updated history
    logits: torch.Tensor | None = None  # [B, num_codebooks, V] when asked (tests, parity)


@dataclass(frozen=True)
class PromptInfo:
    """How a client builds this checkpoint's text turns (``ModelInfoResponse``): ``prompt_format``
    with ``{speaker}`` and ``{text}`` replaced, tokenized without added special tokens; the
    ``speakers`` by name and the id that replaces ``{speaker}``."""

    prompt_format: str
    speakers: tuple[tuple[str, int], ...] = ()


class TalkerModel(Protocol):
    """A talker family. ``rows_per_request`` is 2 for families that run classifier-free
    guidance as paired rows, 1 otherwise. ``text_vocab_size``: the text ids a prompt may hold.
    ``audio_context``: whether a prompt's earlier turns carry their audio frames (CSM: a session's
    next segment is prefilled after the earlier ones, behind an audio-context boundary) or only
    their text (Qwen2.5-Omni: a session's next segment is prefilled again from position 0 with the
    earlier turns' text as context; services/talker/sessions.py)."""

    num_codebooks: int
    codebook_size: int
    text_vocab_size: int
    hidden_size: int
    max_len: int
    frame_rate: float
    sample_rate: int
    rows_per_request: int
    audio_context: bool

    def prompt_embeds(self, segments: Sequence[PromptSegment]) -> torch.Tensor:
        """The prompt as input embeddings [T, H] (the reference ``embed_packed`` must equal)."""

    def pack_prompt(self, segments: Sequence[PromptSegment]) -> np.ndarray:
        """The prompt as host rows [T, N + 1] int64, one per KV position: what a request carries
        to the engine. Pure host code (no device, no model state), so the servicer can call it
        on its event loop when a request arrives."""

    def pack_slot_state(self, segments: Sequence[PromptSegment]) -> np.ndarray | None:
        """The request's per-slot state beyond its packed prompt, as a host int64 vector [S], or
        None when the family keeps none. Host code, like ``pack_prompt``; the request carries it
        and the engine writes it (``write_slot_state``) with the prompt's final chunk."""

    def write_slot_state(self, caches: Any, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Sets the state of ``slots`` [R] from ``states`` [R, S] int64 on the device (each row a
        ``pack_slot_state`` vector, right-padded with -1): device work only, no host sync. Called
        after the slots' final prefill chunk; every frame of the slot reads it from the caches."""

    def embed_packed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Packed rows [T, N + 1] or [B, T, N + 1] on the device -> embeddings [.., T, H], equal to
        ``prompt_embeds`` of the same prompt; no host sync, no branches on values."""

    def new_caches(self, num_slots: int, max_len: int, batch_size: int) -> Any:
        """Static caches for ``num_slots`` rows of up to ``max_len`` positions, with frame
        scratch space for batches of up to ``batch_size`` rows."""

    def prefill(self, embeds: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                caches: Any, starts: torch.Tensor | None = None) -> torch.Tensor:
        """Runs right-padded prompt chunks [B, T, H] (true lengths [B]) into their slots at
        positions ``starts + 0 .. T-1`` (``starts`` [B], default 0: whole prompts); returns each
        row's hidden state at its last true position [B, H]. Padding positions may write K/V
        past a row's end (clamped to the cache): the row's next chunk or frame rewrites them
        before any query sees them."""

    def decode_frame(self, inputs: FrameInputs, caches: Any, return_logits: bool = False) -> FrameOutputs:
        """Produces one frame per row and advances the backbone by that frame."""
