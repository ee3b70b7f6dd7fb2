"""A small eager generation API over a talker family: prefill a batch of prompts (text
turns and audio-context turns), decode frame by frame, stop each row on its own.

This is the reference path the engine's graphs are checked against, and what tests and
tools use directly. It makes one device-to-host copy per frame; the engine makes one per
K frames. Rows keep their own positions and KV slots, so a batch of prompts of
different lengths needs no padding inside attention. A family's slot state (the Qwen-Omni
talker's reply stream: ``TalkerModel.pack_slot_state``) is written after the prefill, as the
engine writes it with a prompt's final chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.sampler_twin import SamplingParams
from models.family import FrameInputs, PromptSegment, TalkerModel
from services.common.sampling import Sampling

__all__ = ["GenerationRequest", "GenerationResult", "Sampling", "generate", "sampling_params"]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class GenerationRequest:
    segments: Sequence[PromptSegment]
    max_frames: int
    min_frames: int = 0
    sampling: Sampling = field(default_factory=Sampling)


@dataclass
class GenerationResult:
    codes: torch.Tensor            # [F, num_codebooks] int64 on the CPU: the audio frames
    finish_reason: str             # "stop" (the stop frame came; not included) or "length"
    logits: torch.Tensor | None = None  # [F', num_codebooks, V] per decoded frame, F' >= F


def sampling_params(samplings: Sequence[Sampling], device: torch.device) -> SamplingParams:
    return SamplingParams.from_lists(
        temperature=[s.temperature for s in samplings], top_k=[s.top_k for s in samplings],
        top_p=[s.top_p for s in samplings],
        repetition_penalty=[s.repetition_penalty for s in samplings],
        repetition_window=[s.repetition_window for s in samplings],
        seed=[s.seed for s in samplings], device=device)


def _check(request: GenerationRequest, prompt_len: int, max_len: int, index: int) -> None:
    if request.max_frames < 1:
        raise ValueError(f"requests[{index}].max_frames must be >= 1, got {request.max_frames}")
    if request.min_frames < 0:
        raise ValueError(f"requests[{index}].min_frames must be >= 0, got {request.min_frames}")
    if prompt_len + request.max_frames > max_len:
        raise ValueError(f"requests[{index}]: prompt ({prompt_len}) + max_frames "
                         f"({request.max_frames}) exceeds the model's max length {max_len}")


def _write_slot_states(model: TalkerModel, requests: Sequence[GenerationRequest], caches,
                       device: torch.device) -> None:
    """Each row's slot state (row i is slot i), right-padded with -1, where the family keeps one."""
    states = [model.pack_slot_state(r.segments) for r in requests]
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return
    host = np.full((len(rows), max(len(states[i]) for i in rows) or 1), -1, dtype=np.int64)
    for row, i in enumerate(rows):
        host[row, : len(states[i])] = states[i]
    model.write_slot_state(caches, torch.tensor(rows, dtype=torch.int64, device=device),
                           torch.from_numpy(host).to(device))


@torch.inference_mode()
def generate(model: TalkerModel, requests: Sequence[GenerationRequest],
             return_logits: bool = False, cache_len: int | None = None) -> list[GenerationResult]:
    """Generates every request in one batch; each row stops on its own. ``cache_len``
    sets the KV cache length (default: just enough); the engine's length gives
    bit-identical attention to the engine's."""
    device = next(model.parameters()).device
    prompts = [model.prompt_embeds(r.segments) for r in requests]
    lengths_cpu = [p.shape[0] for p in prompts]
    for i, (request, length) in enumerate(zip(requests, lengths_cpu, strict=True)):
        _check(request, length, model.max_len, i)
    b = len(requests)
    max_frames = max(r.max_frames for r in requests)
    cache_len = cache_len or min(model.max_len, max(lengths_cpu) + max_frames)
    caches = model.new_caches(num_slots=b, max_len=cache_len, batch_size=b)
    embeds = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)  # [B, T, H]
    lengths = torch.tensor(lengths_cpu, dtype=torch.int64, device=device)
    slots = torch.arange(b, device=device)
    hidden = model.prefill(embeds, lengths, slots, caches)
    _write_slot_states(model, requests, caches, device)

    window = max(r.sampling.repetition_window for r in requests)
    history = torch.full((b, model.num_codebooks, window), -1, dtype=torch.int64, device=device)
    sampling = sampling_params([r.sampling for r in requests], device)
    min_frames = torch.tensor([r.min_frames for r in requests], dtype=torch.int64, device=device)
    frames: list[list[torch.Tensor]] = [[] for _ in requests]
    logits: list[list[torch.Tensor]] = [[] for _ in requests]
    finish: list[str | None] = [None] * b
    for f in range(max_frames):
        inputs = FrameInputs(hidden=hidden, slots=slots,
                             positions=(lengths + f).clamp(max=cache_len - 1),
                             frame_index=torch.full((b,), f, dtype=torch.int64, device=device),
                             min_frames=min_frames, sampling=sampling, history=history)
        out = model.decode_frame(inputs, caches, return_logits=return_logits)
        hidden, history = out.hidden, out.history
        codes, stop = out.codes.cpu(), out.stop.cpu()
        for row, request in enumerate(requests):
            if finish[row] is not None:
                continue  # a finished row rides along until the batch ends; nothing is kept
            if return_logits:
                logits[row].append(out.logits[row].cpu())
            if stop[row]:
                finish[row] = FINISH_STOP
                continue
            frames[row].append(codes[row])
            if len(frames[row]) == request.max_frames:
                finish[row] = FINISH_LENGTH
        if all(reason is not None for reason in finish):
            break
    return [GenerationResult(
        codes=torch.stack(rows) if rows else torch.empty(0, model.num_codebooks, dtype=torch.int64),
        finish_reason=reason, logits=torch.stack(lg) if return_logits and lg else None)
        for rows, reason, lg in zip(frames, finish, logits, strict=True)]
