"""Streaming Token2Wav over a resident slot pool: codes pushed piecewise per stream, and
per tick ONE batched DiT solve for every ready chunk of every stream, then the vocoder
batched too. Equal to the windowed reference of :mod:`models.qwen_omni.window` (its
module doc defines chunks, windows, R and the noise).

Use::

    s = StreamingToken2Wav(t2w, max_slots=64)              # window: StreamWindow.of(...)
    s.open(slot, s.voice("Chelsie", cond, ref_mel), seed)  # the voice's encoder runs once
    s.push(slot, codes)                                    # any number of codes, any time
    s.end(slot)                                            # no more codes: flush the rest
    out = s.decode([x for x in open_slots if s.ready(x)])  # one tick: {slot: StreamChunk}

Per slot: the voice rows (resident pool tensors, a spare row for padding), the noise key,
the codes from the next chunk's window start on, the final mel from R frames before the
next audio frame on, and the audio position. A tick:

1. DiT: each ready chunk is a row: its window's codes right-padded to the fixed window
   (L + C + A blocks), rows padded to a bucket on the spare slot; one
   :func:`models.qwen_omni.dit_batch.solve_windows` (rows x {cond, uncond} per
   evaluation); each row's chunk cropped and appended to its stream's mel.
2. Vocoder: a stream's audio goes up to the frame R before its last final mel frame (all
   of it once ended), in pieces of at most a chunk, each on its mel +-R. A piece whose
   right context is real mel is right-padded to C + 2R frames (the padding is more than R
   frames from its samples, so they do not change): one call. An ended stream's audio
   within R of its end is one piece that cannot be padded (the vocoder's edge padding is
   part of its output): such pieces run in one call per length.

First audio: after :meth:`StreamWindow.first_audio_codes` codes, at most (C + A) blocks +
R frames' worth. CUDA graphs (:meth:`StreamingToken2Wav.capture_graphs`,
:mod:`models.qwen_omni.stream_graphs`): the DiT solve per row bucket (one window length),
the steady vocoder call per row bucket (C + 2R frames); the end pieces stay eager. With
graphs, rows pad to the captured buckets, so eager and replayed calls run the same shapes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from models.qwen_omni.dit import VoiceCondition
from models.qwen_omni.dit_batch import solve_windows
from models.qwen_omni.stream_graphs import StreamGraphs
from models.qwen_omni.token2wav import Token2Wav
from models.qwen_omni.window import StreamWindow, noise_key


@dataclass(frozen=True)
class StreamChunk:
    """What one decode produced for a stream: audio (clamped to [-1, 1]) from sample
    ``first_sample`` on, the mel frames that became final from ``first_frame`` on, and
    whether this was the stream's last audio."""

    wave: torch.Tensor
    first_sample: int
    mel: torch.Tensor
    first_frame: int
    finished: bool


@dataclass
class _Slot:
    key: int
    codes: list[int] = field(default_factory=list)
    codes_base: int = 0      # absolute index of codes[0]
    received: int = 0
    ended: bool = False
    chunks_done: int = 0
    mel: torch.Tensor | None = None  # final mel frames [mel_base, mel_base + width)
    mel_base: int = 0
    emitted: int = 0         # audio frames returned


@dataclass(frozen=True)
class _Piece:
    slot: int
    first: int               # audio frames [first, last)
    last: int
    lo: int                  # its vocoder input: mel frames [lo, hi)
    hi: int
    at_end: bool             # hi is the stream's end: run unpadded


def _bucket(rows: int, buckets: Sequence[int]) -> int:
    return min((b for b in buckets if b >= rows), default=rows)


class StreamingToken2Wav:
    def __init__(self, model: Token2Wav, max_slots: int, window: StreamWindow | None = None, *,
                 steps: int = 10, guidance: float = 0.5, sway: float | None = -1.0,
                 row_buckets: Iterable[int] = ()) -> None:
        self.model, self.max_slots = model, max_slots
        self.window = window or StreamWindow.of(model.config)
        self.steps, self.guidance, self.sway = steps, guidance, sway
        self.row_buckets = sorted(set(row_buckets))
        dit = model.config.dit
        if self.window.window_frames > dit.max_position_embeddings:
            raise ValueError(f"a window of {self.window.window_frames} mel frames exceeds "
                             f"max_position_embeddings {dit.max_position_embeddings}")
        weight = model.dit.proj_out.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.hop = model.config.bigvgan.hop_length
        rows = max_slots + 1  # the last: the spare slot of padding rows
        self._speaker = torch.zeros(rows, dit.enc_emb_dim, device=self.device, dtype=self.dtype)
        self._reference = torch.zeros(rows, dit.enc_dim, device=self.device, dtype=self.dtype)
        self._null_reference = torch.zeros_like(self._reference)
        self.voices: dict[str, VoiceCondition] = {}
        self.slots: dict[int, _Slot] = {}
        self.shapes: Counter[tuple[str, int, int]] = Counter()  # (call, rows, frames) -> calls
        self.graphs = StreamGraphs()  # none until capture_graphs

    # --- streams ------------------------------------------------------------------------------

    def voice(self, name: str, cond: torch.Tensor | None = None,
              ref_mel: torch.Tensor | None = None) -> VoiceCondition:
        """The voice ``name``'s conditioning, computed on first use (cond (1, enc_emb_dim),
        ref_mel (1, T_ref, mel_dim)) and cached: the speaker encoder runs once per voice."""
        if name not in self.voices:
            if cond is None or ref_mel is None:
                raise KeyError(f"voice {name!r} is not cached: give its cond and ref_mel")
            self.voices[name] = self.model.voice(cond.to(self.device, self.dtype),
                                                 ref_mel.to(self.device, self.dtype))
        return self.voices[name]

    def open(self, slot: int, voice: VoiceCondition, seed: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is not in [0, {self.max_slots})")
        if slot in self.slots:
            raise ValueError(f"slot {slot} is open")
        if voice.speaker.shape[0] != 1:
            raise ValueError("one voice (batch 1) per stream")
        self._speaker[slot] = voice.speaker[0]
        self._reference[slot] = voice.reference[0]
        self._null_reference[slot] = voice.null_reference[0]
        self.slots[slot] = _Slot(noise_key(seed))

    def push(self, slot: int, codes: Sequence[int] | torch.Tensor) -> None:
        state = self._slot(slot)
        if state.ended:
            raise ValueError(f"slot {slot}: codes after end()")
        values = [int(c) for c in (codes.reshape(-1).tolist() if torch.is_tensor(codes) else codes)]
        top = self.model.config.dit.num_embeds
        if any(not 0 <= c <= top for c in values):
            raise ValueError(f"slot {slot}: codes must be in [0, {top}]")
        state.codes.extend(values)
        state.received += len(values)

    def end(self, slot: int) -> None:
        """No more codes: the rest (the last chunks, without lookahead) becomes ready."""
        self._slot(slot).ended = True

    def close(self, slot: int) -> None:
        """Frees the slot (finished or not). Idempotent."""
        self.slots.pop(slot, None)

    def ready(self, slot: int) -> int:
        """Work decodable now: the DiT chunks whose window's codes have arrived, plus one for
        an ended stream's audio still owed when no chunk is left (0: nothing to decode)."""
        state = self._slot(slot)
        chunks = self.window.ready_chunks(state.received, state.ended) - state.chunks_done
        if chunks > 0:
            return chunks
        return int(state.ended and state.emitted < state.received * self.window.repeats)

    def finished(self, slot: int) -> bool:
        """All of an ended stream's audio was returned."""
        state = self._slot(slot)
        return state.ended and state.emitted == state.received * self.window.repeats

    def _slot(self, slot: int) -> _Slot:
        if slot not in self.slots:
            raise KeyError(f"slot {slot} is not open")
        return self.slots[slot]

    # --- the tick -----------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, slots: Sequence[int]) -> dict[int, StreamChunk]:
        """Every ready chunk of ``slots`` in one DiT solve, then their audio: {slot: StreamChunk}
        (an empty wave where no audio became due)."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots repeat: {list(slots)}")
        states = {slot: self._slot(slot) for slot in slots}
        mel_from = {slot: s.mel_base + self._width(s) for slot, s in states.items()}
        self._run_dit(states)
        pieces = [p for slot, state in states.items() for p in self._pieces(slot, state)]
        waves = self._run_vocoder(pieces)
        by_slot: dict[int, list[torch.Tensor]] = {slot: [] for slot in states}
        for piece, wave in zip(pieces, waves, strict=True):
            by_slot[piece.slot].append(wave)
            states[piece.slot].emitted = piece.last
        out = {}
        for slot, state in states.items():
            mel = (state.mel[:, mel_from[slot] - state.mel_base:] if state.mel is not None else
                   torch.zeros(self.model.config.dit.mel_dim, 0, device=self.device, dtype=self.dtype))
            wave = (torch.cat(by_slot[slot]) if by_slot[slot] else
                    torch.zeros(0, device=self.device, dtype=self.dtype))
            first_sample = state.emitted * self.hop - wave.shape[0]
            out[slot] = StreamChunk(wave, first_sample, mel, mel_from[slot], self.finished(slot))
            self._trim(state)
        return out

    @staticmethod
    def _width(state: _Slot) -> int:
        return 0 if state.mel is None else state.mel.shape[1]

    def _run_dit(self, states: dict[int, _Slot]) -> None:
        rows = [(slot, chunk) for slot, state in states.items()
                for chunk in range(state.chunks_done,
                                   self.window.ready_chunks(state.received, state.ended))]
        if not rows:
            return
        win, n = self.window, len(rows)
        bucket = _bucket(n, self.row_buckets)
        codes = torch.zeros(bucket, win.window_codes, dtype=torch.int64)
        lengths = torch.full((bucket,), win.window_codes, dtype=torch.int64)
        starts = torch.zeros(bucket, dtype=torch.int64)
        keys = torch.zeros(bucket, dtype=torch.int64)
        ids = torch.full((bucket,), self.max_slots, dtype=torch.int64)
        spans = []
        for row, (slot, chunk) in enumerate(rows):
            state = states[slot]
            start, end = win.window(chunk, state.received if state.ended else None)
            base = state.codes_base
            codes[row, :end - start] = torch.tensor(state.codes[start - base:end - base])
            lengths[row], starts[row], keys[row], ids[row] = end - start, start * win.repeats, state.key, slot
            first = chunk * win.chunk_frames
            last = min(first + win.chunk_frames, state.received * win.repeats)
            spans.append((first - start * win.repeats, last - first))
        mel = self._solve(codes, lengths, starts, keys, ids)
        for (slot, _), row_mel, (offset, width) in zip(rows, mel, spans, strict=False):
            state = states[slot]
            piece = row_mel[:, offset:offset + width]
            state.mel = piece if state.mel is None else torch.cat([state.mel, piece], dim=1)
            state.chunks_done += 1

    def _solve(self, codes: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, keys: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
        """The batched DiT call of rows x window: replayed where its bucket has a graph."""
        self.shapes["dit", codes.shape[0], codes.shape[1] * self.window.repeats] += 1
        inputs = [t.to(self.device, non_blocking=True) for t in (codes, lengths, starts, keys, ids)]
        graph = self.graphs.dit.get(codes.shape[0])
        return graph(*inputs) if graph is not None else self._solve_on_device(*inputs)

    def _solve_on_device(self, codes: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor,
                         keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """What a DiT graph captures: the voice rows gathered from the pool, the solve."""
        voice = VoiceCondition(self._speaker[ids], self._reference[ids], self._null_reference[ids])
        return solve_windows(self.model.dit, codes, lengths, starts, keys, voice, self.steps, self.guidance,
                             self.sway)

    def _vocode(self, mel: torch.Tensor) -> torch.Tensor:
        """The clamped wave of mel (rows, mel_dim, frames): replayed for a steady call of a bucket
        with a graph."""
        graph = self.graphs.vocoder.get(mel.shape[0])
        if graph is not None and graph.inputs[0].shape == mel.shape:
            return graph(mel)
        return self.model.vocode(mel)[0]

    def capture_graphs(self, buckets: Sequence[int], max_graphs: int, max_mb: float) -> list[int]:
        """CUDA graphs of the DiT solve and the steady vocoder call for ``buckets`` (rows at most
        ``max_slots``), within the budget; rows then pad to the buckets captured (returned)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        win, mel_dim = self.window, self.model.config.dit.mel_dim
        steady = win.chunk_frames + 2 * win.vocoder_field
        on = {"device": self.device, "dtype": torch.int64}

        def dit_inputs(rows: int) -> list[torch.Tensor]:  # padding rows on the spare slot
            codes = torch.zeros(rows, win.window_codes, **on)
            return [codes, torch.full((rows,), win.window_codes, **on), torch.zeros(rows, **on),
                    torch.zeros(rows, **on), torch.full((rows,), self.max_slots, **on)]

        def mel_input(rows: int) -> torch.Tensor:
            return torch.zeros(rows, mel_dim, steady, device=self.device, dtype=self.dtype)

        self.graphs.capture(self._solve_on_device, lambda mel: self.model.vocode(mel)[0], dit_inputs,
                            mel_input, [b for b in buckets if b <= self.max_slots], max_graphs, max_mb)
        self.row_buckets = self.graphs.buckets
        return self.row_buckets

    def _pieces(self, slot: int, state: _Slot) -> list[_Piece]:
        """The stream's audio due now, in pieces of at most a chunk, with their vocoder input."""
        final = state.mel_base + self._width(state)
        done = state.ended and state.chunks_done == self.window.chunks(state.received)
        reach, step = self.window.vocoder_field, self.window.chunk_frames
        due = final if done else final - reach
        pieces = []
        for first in range(state.emitted, due, step):
            last = min(first + step, due)
            if done and last + reach >= final:  # the rest reaches the end: one unpadded piece
                pieces.append(_Piece(slot, first, final, max(0, first - reach), final, True))
                break
            pieces.append(_Piece(slot, first, last, max(0, first - reach), last + reach, False))
        return pieces

    def _run_vocoder(self, pieces: list[_Piece]) -> list[torch.Tensor]:
        """Steady pieces in one call, right-padded to C + 2R frames; end pieces by length."""
        if not pieces:
            return []
        width = self.window.chunk_frames + 2 * self.window.vocoder_field
        groups: dict[int, list[int]] = {}
        for i, piece in enumerate(pieces):
            groups.setdefault(piece.hi - piece.lo if piece.at_end else width, []).append(i)
        waves: list[torch.Tensor] = [torch.zeros(0)] * len(pieces)
        for frames, members in groups.items():
            rows = [self._vocoder_input(pieces[i], frames) for i in members]
            bucket = _bucket(len(rows), self.row_buckets) if frames == width else len(rows)
            rows += [torch.zeros_like(rows[0])] * (bucket - len(rows))
            self.shapes["vocoder", bucket, frames] += 1
            wave = self._vocode(torch.stack(rows))
            for row, i in enumerate(members):
                p = pieces[i]
                waves[i] = wave[row, (p.first - p.lo) * self.hop:(p.last - p.lo) * self.hop]
        return waves

    def _vocoder_input(self, piece: _Piece, frames: int) -> torch.Tensor:
        state = self.slots[piece.slot]
        mel = state.mel[:, piece.lo - state.mel_base:piece.hi - state.mel_base]
        pad = frames - mel.shape[1]
        return torch.cat([mel, mel[:, -1:].expand(-1, pad)], dim=1) if pad else mel

    def _trim(self, state: _Slot) -> None:
        """Keeps the codes from the next window's start and the mel from R frames before the
        next audio frame."""
        keep, _ = self.window.window(state.chunks_done)
        if keep > state.codes_base:
            del state.codes[:keep - state.codes_base]
            state.codes_base = keep
        drop = state.emitted - self.window.vocoder_field - state.mel_base
        if drop > 0 and state.mel is not None:
            state.mel = state.mel[:, drop:]
            state.mel_base += drop
