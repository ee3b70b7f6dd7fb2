"""One flow-matching solve over the DiT windows of many streams at once (the streaming
decoder's tick): rows of one fixed window length, each right-padded to it with a per-row
valid length, guidance rows [conditional; unconditional] as in
:func:`models.qwen_omni.ode.dit_sample`, the noise drawn on the device from each row's
(key, first absolute frame) (:func:`models.qwen_omni.window.frame_noise`).

A padded row equals its unpadded window: a valid frame attends only valid frames (the block
masks of :func:`models.qwen_omni.dit.block_mask` AND same validity), RoPE positions start
at 0 at the window's first frame either way, and a padding frame attends only padding (so
every query row has a key and padding stays finite). Everything is a function of device
tensors of fixed shapes (rows, window): no host sync, so one (row bucket, window) shape
is one CUDA graph to capture later.
"""

from __future__ import annotations

import dataclasses

import torch

from models.qwen_omni.dit import DiT, SampleContext, VoiceCondition
from models.qwen_omni.ode import integrate, time_grid
from models.qwen_omni.window import frame_noise


def window_context(dit: DiT, codes: torch.Tensor, voice: VoiceCondition, valid: torch.Tensor,
                   guided: bool) -> SampleContext:
    """dit.context with per-row masks (rows, 1, T, T): the block mask AND same validity
    (valid: (B, T) bool; rows = 2B when guided)."""
    ctx = dit.context(codes, voice, guided)
    same = (valid[:, :, None] == valid[:, None, :]).unsqueeze(1)
    if guided:
        same = torch.cat([same, same], dim=0)
    masks = {shape: block & same for shape, block in ctx.masks.items()}
    return dataclasses.replace(ctx, masks=masks)


@torch.no_grad()
def solve_windows(dit: DiT, codes: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor,
                  keys: torch.Tensor, voice: VoiceCondition, steps: int = 10, guidance: float = 0.5,
                  sway: float | None = -1.0) -> torch.Tensor:
    """codes (B, Wc) int64 (padding: any code), lengths (B,) valid codes, starts (B,) the
    absolute mel frame of each row's first frame, keys (B,) noise keys, voice B rows ->
    mel (B, mel_dim, Wc * repeats); frames past a row's length are padding."""
    repeats, mel_dim = dit.config.repeats, dit.config.mel_dim
    frames = codes.shape[1] * repeats
    dtype = voice.speaker.dtype
    valid = torch.arange(frames, device=codes.device)[None, :] < (lengths * repeats)[:, None]
    guided = guidance >= 1e-5
    ctx = window_context(dit, codes, voice, valid, guided)

    def velocity(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = dit.velocity(x, t, ctx)
        if not guided:
            return out
        cond, uncond = torch.chunk(out, 2, dim=0)
        return cond + (cond - uncond) * guidance

    noise = frame_noise(keys, starts, frames, mel_dim, dtype)
    times = time_grid(steps, sway, device=codes.device, dtype=dtype)
    return integrate(velocity, noise, times).permute(0, 2, 1)
