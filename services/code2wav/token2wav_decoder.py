"""The streaming decoder of the Qwen2.5-Omni family (services/code2wav/decoding.py): Token2Wav
through :class:`models.qwen_omni.streaming.StreamingToken2Wav` on a resident slot pool.

Per request it needs a voice and a seed (``OpenRequest.speaker_id`` and ``seed``): the voice is
one of the checkpoint's speakers (models/qwen_omni/speakers.py; their conditioning computed once
at start-up), an unknown id is INVALID_ARGUMENT naming ``speaker_id``; the seed keys the stream's
flow-matching noise (a function of seed and absolute mel frame, so the audio does not depend on
the batch or the chunking). Codes are one codebook; the DiT embeds ``0 .. num_embeds``; the
talker's codec ids above that (its specials) are dropped by the engine before they get here.

Audio comes later than its codes: a chunk of C blocks is decoded once its window's lookahead
(A blocks) arrived, and its samples are final R mel frames later (the vocoder's reach), so a
stream's first audio needs :meth:`StreamWindow.first_audio_codes` codes unless it ends first.
One :meth:`decode` runs one batched DiT solve for every ready chunk of the tick's slots and the
vocoder on their audio due, then converts it to int16 on the device and copies it back once.
On CUDA, the DiT solve and the steady vocoder call are replayed from graphs captured at
start-up per row bucket (``graphs``: the engine section's ``graph_buckets``, ``max_graphs`` and
``max_graph_mb``; models/qwen_omni/stream_graphs.py), rows padded to the captured buckets;
``deterministic`` restricts cuDNN to fixed-order sums, as for the CSM codec. Eager on the CPU.

The family has no clip encoder (transformers has none either): ``encode_clip`` is
FAILED_PRECONDITION.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from models.qwen_omni.config import SAMPLE_RATE
from models.qwen_omni.speakers import SpeakerVoice
from models.qwen_omni.streaming import StreamingToken2Wav
from models.qwen_omni.token2wav import Token2Wav
from models.qwen_omni.window import StreamWindow
from services.code2wav.decoding import StreamAudio, to_pcm16
from services.common.errors import FailedPrecondition, InvalidArgument

FAMILY = "qwen_omni"


@dataclass(frozen=True)
class GraphBudget:
    """Which row buckets get CUDA graphs, and the most graphs and pool memory they may take."""

    buckets: tuple[int, ...]
    max_graphs: int
    max_mb: float


class Token2WavDecoder:
    streaming = True
    num_codebooks = 1

    def __init__(self, model: Token2Wav, speakers: Sequence[SpeakerVoice], max_slots: int, *,
                 code_space: int, window: StreamWindow | None = None, steps: int = 10,
                 guidance: float = 0.5, sway: float | None = -1.0, row_buckets: Sequence[int] = (),
                 graphs: GraphBudget | None = None, deterministic: bool = True) -> None:
        self.stream = StreamingToken2Wav(model, max_slots, window, steps=steps, guidance=guidance, sway=sway,
                                         row_buckets=row_buckets)
        if self.stream.device.type == "cuda":  # before any capture: a graph keeps the algorithms it saw
            torch.backends.cudnn.deterministic = deterministic
            if deterministic:
                torch.backends.cudnn.benchmark = False
            if graphs is not None and graphs.max_graphs > 0:
                self.stream.capture_graphs(graphs.buckets, graphs.max_graphs, graphs.max_mb)
        self.window = self.stream.window
        dit = model.config.dit
        self.codebook_size = dit.num_embeds + 1   # the DiT's code table: 0 .. num_embeds
        self.code_space = max(code_space, self.codebook_size)  # the talker's codec vocabulary
        self.samples_per_frame = model.config.samples_per_code
        self.sample_rate = SAMPLE_RATE
        self.frame_rate = SAMPLE_RATE / self.samples_per_frame
        self.voices = {s.speaker_id: (s.name, self.stream.voice(s.name, s.cond, s.ref_mel)) for s in speakers}
        self.real_frames_total = 0    # codes of the chunks the DiT made final
        self.padded_frames_total = 0  # codes the DiT calls ran (rows x window, padding included)

    def speakers(self) -> str:
        return ", ".join(f"{i} ({name})" for i, (name, _) in sorted(self.voices.items()))

    def check_open(self, speaker_id: int, seed: int) -> None:
        if speaker_id not in self.voices:
            raise InvalidArgument("speaker_id", f"no speaker {speaker_id} in this model (its speakers: "
                                  f"{self.speakers()})")

    def encode_clip(self, samples: np.ndarray, sample_rate: int) -> torch.Tensor:
        raise FailedPrecondition(f"the {FAMILY} model family has no clip encoder: its voices are the "
                                 f"checkpoint's speakers ({self.speakers()})")

    # --- streams --------------------------------------------------------------------------------

    def open(self, slot: int, speaker_id: int, seed: int) -> None:
        self.check_open(speaker_id, seed)
        self.stream.open(slot, self.voices[speaker_id][1], seed)

    def push(self, slot: int, codes: np.ndarray) -> None:
        self.stream.push(slot, codes[:, 0].tolist())

    def end(self, slot: int) -> None:
        self.stream.end(slot)

    def ready(self, slot: int) -> bool:
        return self.stream.ready(slot) > 0

    def finished(self, slot: int) -> bool:
        return self.stream.finished(slot)

    def close(self, slot: int) -> None:
        self.stream.close(slot)

    # --- the tick ---------------------------------------------------------------------------------

    def decode(self, slots: Sequence[int]) -> list[StreamAudio]:
        """One streaming decode of ``slots`` (each ready): their audio as int16, one copy back."""
        dit_before = self._dit_codes()
        out = self.stream.decode(list(slots))
        chunks = [out[slot] for slot in slots]
        lengths = [int(c.wave.shape[0]) for c in chunks]
        if sum(lengths):
            flat = to_pcm16(torch.cat([c.wave for c in chunks if c.wave.shape[0]])).cpu().numpy()
        else:
            flat = np.zeros(0, np.int16)
        bounds = np.cumsum([0, *lengths])
        self.real_frames_total += sum(int(c.mel.shape[1]) for c in chunks) // self.window.repeats
        self.padded_frames_total += self._dit_codes() - dit_before
        return [StreamAudio(flat[bounds[i]:bounds[i + 1]], c.first_sample, c.finished)
                for i, c in enumerate(chunks)]

    def _dit_codes(self) -> int:
        return sum(rows * frames * n for (call, rows, frames), n in self.stream.shapes.items()
                   if call == "dit") // self.window.repeats


__all__ = ["FAMILY", "GraphBudget", "Token2WavDecoder"]
