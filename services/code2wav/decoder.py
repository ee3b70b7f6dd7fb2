"""Batched streaming decode calls, replayed from CUDA graphs where one was captured.

A decode call is (rows, chunk frames T). On CUDA, graphs are captured at start-up for
the configured (batch bucket, T) shapes, largest first into one memory pool, until the
count or memory budget is spent; a call whose T has a graph runs in the smallest bucket
that holds its rows, padded with a spare slot whose state is never read. Any other
shape runs eagerly through the same ``decode_step``; each such shape is logged once.
On the CPU everything runs eagerly.

Mixed chunk lengths: :meth:`CodecDecoder.decode_many` decodes rows of different frame
counts: with graphs, in the calls services/common/buckets.py plans (rows grouped by the
graph length that holds them, each group in buckets that pad little), each row
right-padded to its call's length with a per-row valid length (see
``MimiCodec.decode_step``); every graph takes the lengths as an input buffer too, its
padding rows on the spare slot with all T frames valid. Eagerly, one call of the longest.

Deterministic (the default): on CUDA, cuDNN may pick convolution algorithms whose sums
run in a varying order (the transposed convolutions of the upsampling stack, from batch 8
at 8 frames in bf16 on an H200), so the same codes decoded twice give waveforms a few
bf16 ulps apart, graph replay and eager alike. ``deterministic`` restricts cuDNN to
algorithms that sum in a fixed order. The switch is the process's
(``torch.backends.cudnn.deterministic``): Code2Wav runs in its own process.

The engine's aligned decoder (services/code2wav/decoding.py): exactly the audio of the frames
given, at once. The codec takes no voice (the talker's prompt carries it): an Open's
``speaker_id`` and ``seed`` are ignored; voice clips go through the codec's encoder.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from models.mimi.model import CodecInputError, MimiCodec
from services.code2wav.voice import encode_voice
from services.common.buckets import length_at_most, padded_length, plan

DECODE_RANGE = "voxring.decode"  # the range a device profile attributes Code2Wav's kernels to

log = logging.getLogger(__name__)


class CodecDecoder:
    streaming = False

    def __init__(self, codec: MimiCodec, max_slots: int, *, buckets: Sequence[int] = (),
                 chunk_frames: Sequence[int] = (), max_graphs: int = 0, max_graph_mb: float = 0.0,
                 deterministic: bool = True) -> None:
        self.codec = codec
        self.device = codec.upsample.conv.weight.device
        if self.device.type == "cuda":  # before any capture: a graph keeps the algorithms it saw
            torch.backends.cudnn.deterministic = deterministic
            if deterministic:
                torch.backends.cudnn.benchmark = False
        self.pad_slot = max_slots  # spare slot for padding rows
        self.chunk_frames = sorted(set(chunk_frames))
        self.padded_frames_total = 0  # frames the decode calls ran, padding included ...
        self.real_frames_total = 0    # ... and the chunks' own
        codec.allocate(max_slots + 1)
        # (bucket, T) -> (graph, slot ids, codes, lengths, audio out): the first four its inputs
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor,
                                                 torch.Tensor, torch.Tensor]] = {}
        self._eager_logged: set[tuple[int, int]] = set()
        if self.device.type == "cuda" and max_graphs > 0:
            self._capture(sorted(buckets), sorted(chunk_frames), max_graphs, max_graph_mb)
        self.buckets = sorted({b for b, _ in self.graphs})
        config = codec.config
        self.num_codebooks = codec.num_codebooks
        self.codebook_size = self.code_space = config.codebook_size  # no special codes
        self.frame_rate, self.sample_rate = config.frame_rate, config.sampling_rate

    def check_open(self, speaker_id: int, seed: int) -> None:
        """Any Open: the voice is in the talker's prompt, the codec draws no noise."""

    def encode_clip(self, samples: np.ndarray, sample_rate: int) -> torch.Tensor:
        """A voice clip as codec frames [T, K] (services/code2wav/voice.py)."""
        return encode_voice(self.codec, samples, sample_rate)

    def reset(self, slots: Sequence[int]) -> None:
        """Zeroes the streaming state of ``slots`` (newly opened streams), in one batch."""
        self.codec.reset(torch.tensor(list(slots), device=self.device))

    @torch.inference_mode()
    def decode_pcm(self, slots: Sequence[int], codes: np.ndarray) -> np.ndarray:
        """codes: [n, T, K] int16 on the host -> int16 PCM [n, T * spf] on the host: the decode,
        the conversion on the device, and one device-to-host copy."""
        batch = torch.from_numpy(codes.astype(np.int64)).to(self.device).transpose(1, 2)
        return _pcm(self.decode(slots, batch)).cpu().numpy()

    @torch.inference_mode()
    def decode_many(self, slots: Sequence[int], chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """chunks: one int16 [t_i, K] array per slot (t_i >= 1, may differ) -> one int16 PCM
        array of t_i * spf samples per slot. With graphs, the calls services/common/buckets.py
        plans (rows grouped by the graph length they pad to, each group in buckets that pad
        little), launched back to back; eagerly, one call of the longest chunk. Either way
        the PCM conversion on the device and one device-to-host copy. Each slot's stream
        advances by its own t_i."""
        if len(chunks) != len(slots):
            raise CodecInputError(f"{len(chunks)} chunks for {len(slots)} slots")
        if not chunks:
            return []
        frames = _chunk_frames(chunks)
        graphed = bool(self.graphs)
        calls = plan(frames, self.chunk_frames if graphed else (), self.buckets if graphed else ())
        with torch.profiler.record_function(DECODE_RANGE):  # a device profile's share (device_profile.py)
            outputs = [self.decode(*inputs) for inputs in self._stage(calls, slots, chunks)]
            flat = to_host(torch.cat([_pcm(out).reshape(-1) for out in outputs]))  # one copy back
        spf = self.codec.config.samples_per_frame
        pcm: list[np.ndarray] = [np.empty(0, np.int16)] * len(chunks)
        start = 0
        for call in calls:
            for row in call.rows:
                pcm[row] = flat[start: start + frames[row] * spf]
                start += call.frames * spf
        self.padded_frames_total += sum(c.frames * self.bucket_rows(len(c.rows), c.frames) for c in calls)
        self.real_frames_total += sum(frames)
        return pcm

    def _stage(self, calls, slots: Sequence[int], chunks: Sequence[np.ndarray]) -> list[tuple]:
        """Every call's inputs (slot ids, codes [n, K, T] right-padded to the call's T, valid
        lengths or None when all are T and no graph needs them) in one host array, copied to the
        device at once: from pinned memory on CUDA, so the copy neither waits for the calls already
        queued nor makes the next call's launch wait for it (a pageable copy does both)."""
        num_codebooks = chunks[0].shape[1]
        host = np.zeros(sum(len(c.rows) * (2 + c.frames * num_codebooks) for c in calls), np.int64)
        spans, start = [], 0
        for call in calls:
            n, frames = len(call.rows), call.frames
            ids, lengths = host[start:start + n], host[start + n:start + 2 * n]
            codes = host[start + 2 * n:start + n * (2 + frames * num_codebooks)]
            codes = codes.reshape(n, frames, num_codebooks)
            for i, row in enumerate(call.rows):
                ids[i], lengths[i] = slots[row], len(chunks[row])
                codes[i, :len(chunks[row])] = chunks[row]
            spans.append((start, n, frames, bool(self.graphs) or int(lengths.min()) < frames))
            start += n * (2 + frames * num_codebooks)
        staged = torch.from_numpy(host)
        if self.device.type == "cuda":
            staged = staged.pin_memory()
        staged = staged.to(self.device, non_blocking=True)
        return [(staged[o:o + n], staged[o + 2 * n:o + n * (2 + f * num_codebooks)].view(n, f, num_codebooks)
                 .transpose(1, 2), staged[o + n:o + 2 * n] if masked else None) for o, n, f, masked in spans]

    def bucket_rows(self, rows: int, frames: int) -> int:
        """The rows a call of ``rows`` x ``frames`` runs as (its graph's bucket; eagerly: its own)."""
        key = self._graph_key(rows, frames)
        return key[0] if key else rows

    def padded_frames(self, frames: int) -> int:
        """The T a chunk of ``frames`` frames pads to: the smallest captured chunk length that
        holds it (its graph's T), else ``frames`` itself (always when no graph was captured:
        padding is only worth a replay instead of eager ops)."""
        return padded_length(frames, self.chunk_frames) if self.graphs else frames

    def chunk_at_most(self, frames: int) -> int:
        """The longest chunk within ``frames`` that runs unpadded in a graph (``frames`` when no
        graph was captured): the engine cuts chunks to it, the rest waits for the next cut."""
        return length_at_most(frames, self.chunk_frames) if self.graphs else frames

    @torch.inference_mode()
    def decode(self, slots: Sequence[int] | torch.Tensor, codes: torch.Tensor,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
        """slots: n distinct ids (or an int64 tensor of them on the device); codes: [n, K, T]
        int64 on the device; lengths: None (all T frames) or [n] int64 on the device, each 1..T ->
        audio [n, T * spf], row i valid for ``lengths[i] * spf`` samples (see
        ``MimiCodec.decode_step``)."""
        n, _, frames = codes.shape
        ids = slots if torch.is_tensor(slots) else torch.tensor(list(slots), dtype=torch.int64,
                                                                device=self.device)
        key = self._graph_key(n, frames)
        if key is None:
            if (n, frames) not in self._eager_logged and self.graphs:
                log.info("decode shape (batch %d, %d frames) has no graph: runs eagerly", n, frames)
                self._eager_logged.add((n, frames))
            return self.codec.decode_step(ids, codes, lengths)
        graph, slot_buf, codes_buf, lengths_buf, out = self.graphs[key]
        slot_buf.fill_(self.pad_slot)
        slot_buf[:n].copy_(ids)
        codes_buf[n:].zero_()
        codes_buf[:n].copy_(codes)
        lengths_buf.fill_(frames)
        if lengths is not None:
            lengths_buf[:n].copy_(lengths)
        graph.replay()
        return out[:n].clone()

    def _graph_key(self, rows: int, frames: int) -> tuple[int, int] | None:
        fits = [b for (b, t) in self.graphs if t == frames and b >= rows]
        return (min(fits), frames) if fits else None

    def _capture(self, buckets: list[int], frames_list: list[int], max_graphs: int, max_mb: float) -> None:
        pool = None
        spent_mb = 0.0
        # one warm-up stream, its blocks given back after each capture: the allocator caches blocks per
        # stream, so a stream a capture kept each warm-up's memory reserved, counted in the budget
        warmup = torch.cuda.Stream(self.device)
        for frames in reversed(frames_list):
            for bucket in reversed(buckets):
                if len(self.graphs) >= max_graphs:
                    break
                before = torch.cuda.memory_reserved(self.device)
                entry, pool = self._capture_one(bucket, frames, pool, warmup)
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                spent_mb += (torch.cuda.memory_reserved(self.device) - before) / 2**20
                if spent_mb > max_mb:
                    log.warning("codec graph budget (%.0f MB) reached at (batch %d, %d frames)",
                                max_mb, bucket, frames)
                    return
                self.graphs[(bucket, frames)] = entry
        log.info("captured %d codec graphs (%.0f MB): %s", len(self.graphs), spent_mb, sorted(self.graphs))

    @torch.inference_mode()
    def _capture_one(self, bucket: int, frames: int, pool, warmup: torch.cuda.Stream):
        slot_buf = torch.full((bucket,), self.pad_slot, dtype=torch.int64, device=self.device)
        codes_buf = torch.zeros(bucket, self.codec.num_codebooks, frames, dtype=torch.int64,
                                device=self.device)
        lengths_buf = torch.full((bucket,), frames, dtype=torch.int64, device=self.device)
        warmup.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(warmup):
            self.codec.decode_step(slot_buf, codes_buf, lengths_buf)  # warm-up on the spare slot only
        torch.cuda.current_stream(self.device).wait_stream(warmup)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.codec.decode_step(slot_buf, codes_buf, lengths_buf)
        self.codec.reset(torch.tensor([self.pad_slot], device=self.device))
        return (graph, slot_buf, codes_buf, lengths_buf, out), graph.pool()


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a host array. From a GPU through pinned memory and a blocking-sync event:
    the engine thread sleeps until the copy is done instead of spinning in the driver."""
    if tensor.device.type != "cuda":
        return tensor.numpy()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event(blocking=True)
    done.record(torch.cuda.current_stream(tensor.device))
    done.synchronize()
    return host.numpy().copy()  # the pinned block goes back to torch's cache at once


def _pcm(audio: torch.Tensor) -> torch.Tensor:
    """Audio in [-1, 1] (clamped) -> int16 PCM, on the audio's device."""
    return (audio.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)


def _chunk_frames(chunks: Sequence[np.ndarray]) -> list[int]:
    """Each decode_many chunk's frame count; raises CodecInputError unless every chunk is
    [frames >= 1, K] with one K."""
    shapes = [np.shape(c) for c in chunks]
    if any(len(s) != 2 or s[0] < 1 for s in shapes) or len({s[1] for s in shapes}) != 1:
        raise CodecInputError(f"chunks must be [frames >= 1, codebooks] with one codebook count, "
                              f"got shapes {shapes}")
    return [int(s[0]) for s in shapes]
