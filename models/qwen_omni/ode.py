"""Conditional flow matching sampler of the Token2Wav DiT: codes -> mel.

Mirrors transformers' ``Qwen2_5OmniToken2WavDiTModel.sample`` and ``RungeKutta4ODESolver``:

* time grid: ``steps`` points ``linspace(0, 1)`` (so steps - 1 intervals), warped by sway
  sampling ``t += sway * (cos(pi/2 t) - 1 + t)`` (sway = -1: ``t = 1 - cos(pi/2 t)``, denser
  near t = 0);
* solver: Runge-Kutta 4 in its 3/8-rule form, 4 DiT evaluations per interval;
* guidance: each evaluation runs the conditional and the unconditional rows (zero speaker,
  speaker encoder on zeros, code 0 everywhere) as one batch and returns
  ``cond + (cond - uncond) * guidance``; guidance < 1e-5 runs the conditional rows only.

The initial noise is an input (transformers draws ``torch.randn(B, T, mel_dim)``), so tests
and streaming can fix it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from models.qwen_omni.dit import DiT, VoiceCondition

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def time_grid(steps: int, sway: float | None = -1.0, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ODE's ``steps`` time points from 0 to 1 after sway sampling."""
    if steps < 2:
        raise ValueError(f"steps={steps}: at least 2 time points (1 interval)")
    t = torch.linspace(0, 1, steps, device=device, dtype=dtype)
    if sway is not None:
        t += sway * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return t


def rk4_step(f: Velocity, t0: torch.Tensor, t1: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y(t1) by one Runge-Kutta 3/8-rule step, in transformers' operation order."""
    dt = t1 - t0
    third, two_thirds = 1 / 3, 2 / 3
    k1 = f(t0, y)
    k2 = f(t0 + dt * third, y + dt * k1 * third)
    k3 = f(t0 + dt * two_thirds, y + dt * (k2 - k1 * third))
    k4 = f(t1, y + dt * (k1 - k2 + k3))
    return y + (k1 + 3 * (k2 + k3) + k4) * dt / 8


def integrate(f: Velocity, y0: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    y = y0
    for t0, t1 in itertools.pairwise(times):
        y = rk4_step(f, t0, t1, y)
    return y


def guided_velocity(dit: DiT, codes: torch.Tensor, voice: VoiceCondition, guidance: float) -> Velocity:
    """The ODE's right-hand side for one utterance (its per-utterance context built once)."""
    guided = guidance >= 1e-5
    ctx = dit.context(codes, voice, guided)

    def f(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = dit.velocity(x, t, ctx)
        if not guided:
            return out
        cond, uncond = torch.chunk(out, 2, dim=0)
        return cond + (cond - uncond) * guidance

    return f


@torch.no_grad()
def dit_sample(dit: DiT, codes: torch.Tensor, voice: VoiceCondition, noise: torch.Tensor,
               steps: int = 10, guidance: float = 0.5, sway: float | None = -1.0) -> torch.Tensor:
    """codes (B, N) and the initial noise (B, N * repeats, mel_dim) -> mel (B, mel_dim, N * repeats),
    natural-log amplitude (the vocoder's input layout). ``voice`` from
    :func:`models.qwen_omni.dit.prepare_voice` (batch B, or 1 broadcast to B)."""
    frames = codes.shape[1] * dit.config.repeats
    if frames > dit.config.max_position_embeddings:
        raise ValueError(f"{frames} mel frames exceed max_position_embeddings "
                         f"{dit.config.max_position_embeddings}")
    expected = (codes.shape[0], frames, dit.config.mel_dim)
    if tuple(noise.shape) != expected:
        raise ValueError(f"noise shape {tuple(noise.shape)}, expected {expected}")
    voice = _broadcast(voice, codes.shape[0])
    times = time_grid(steps, sway, device=codes.device, dtype=voice.speaker.dtype)
    mel = integrate(guided_velocity(dit, codes, voice, guidance), noise, times)
    return mel.permute(0, 2, 1)


def _broadcast(voice: VoiceCondition, batch: int) -> VoiceCondition:
    if voice.speaker.shape[0] == batch:
        return voice
    if voice.speaker.shape[0] != 1:
        raise ValueError(f"a voice of batch {voice.speaker.shape[0]} for {batch} utterances")
    return VoiceCondition(*(v.expand(batch, -1) for v in (voice.speaker, voice.reference,
                                                          voice.null_reference)))
