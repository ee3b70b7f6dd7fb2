"""Drives :class:`models.qwen_omni.streaming.StreamingToken2Wav` as a serving loop would:
every tick, each open stream gets its next uneven piece of codes (its end with its last),
then ONE decode of every ready stream; the pieces each stream got back are checked for
contiguity and joined."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.qwen_omni.streaming import StreamingToken2Wav

PIECES = (1, 4, 2, 5, 3, 1, 6)  # codes per push, cycled with a per-stream offset


@dataclass
class Run:
    waves: dict[int, torch.Tensor] = field(default_factory=dict)
    mels: dict[int, torch.Tensor] = field(default_factory=dict)
    ticks: int = 0            # ticks that decoded
    first_audio_codes: dict[int, int] = field(default_factory=dict)  # codes pushed at first audio


def drive(streaming: StreamingToken2Wav, codes: dict[int, torch.Tensor], pieces=PIECES,
          max_ticks: int = 1000) -> Run:
    """codes: {open slot: (N,) codes}. Returns each stream's whole wave and mel."""
    run = Run()
    pushed = dict.fromkeys(codes, 0)
    waves: dict[int, list[torch.Tensor]] = {slot: [] for slot in codes}
    mels: dict[int, list[torch.Tensor]] = {slot: [] for slot in codes}
    for tick in range(max_ticks):
        for i, (slot, stream) in enumerate(codes.items()):
            if pushed[slot] < len(stream):
                n = pieces[(tick + i) % len(pieces)]
                streaming.push(slot, stream[pushed[slot]:pushed[slot] + n])
                pushed[slot] = min(len(stream), pushed[slot] + n)
                if pushed[slot] == len(stream):
                    streaming.end(slot)
        ready = [slot for slot in codes if slot in streaming.slots and streaming.ready(slot)]
        if ready:
            run.ticks += 1
            for slot, out in streaming.decode(ready).items():
                assert out.first_sample == sum(len(w) for w in waves[slot])
                assert out.first_frame == sum(m.shape[1] for m in mels[slot])
                if len(out.wave) and slot not in run.first_audio_codes:
                    run.first_audio_codes[slot] = pushed[slot]
                waves[slot].append(out.wave)
                mels[slot].append(out.mel)
                if out.finished:
                    streaming.close(slot)
        if not any(slot in streaming.slots for slot in codes):
            break
    else:
        raise AssertionError(f"streams still open after {max_ticks} ticks")
    run.waves = {slot: torch.cat(w) for slot, w in waves.items()}
    run.mels = {slot: torch.cat(m, dim=1) for slot, m in mels.items()}
    return run
