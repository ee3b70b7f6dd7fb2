"""The modeled device: the talker's runner and Code2Wav's decoder with the real interfaces,
their work put on the modeled GPU (``gpu.py``) at the costs of ``h200.json``.

They return what the real ones return, in the right shapes: codes drawn once at random (the
benchmark's random weights never stop, so a request's length is its ``max_frames``), and
silent PCM. The calling lane is the engine thread that holds the baton.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from bench.sim.costs import DeviceCosts
from bench.sim.gpu import Gpu, GpuJob
from bench.sim.kernel import Sim

NUM_CODEBOOKS, CODEBOOK_SIZE = 32, 2048          # csm-1b's Mimi
FRAME_RATE, SAMPLES_PER_FRAME = 12.5, 1920


def prompt_tokens(segments) -> int:
    """KV positions of a prompt (CSM: text tokens, and an audio turn's frames + its end frame)."""
    return sum(len(s.text_token_ids) + (len(s.frames) + 1 if s.frames is not None else 0) for s in segments)


@dataclass(eq=False)
class StepHandle:
    """A launched decode step: its job on the modeled GPU and the shape ``collect`` returns."""

    job: GpuJob
    rows: int
    k: int
    collected: bool = False


class ModeledRunner:
    """``services.talker.runner.Runner``'s interface: prefill(rows), launch(slots, k) -> handle,
    collect(handle), decode(slots, k) = collect(launch(slots, k)).

    Like the CUDA runner, it has two pinned host buffers for results, so at most two launched
    steps may be uncollected at once (a third would overwrite a result not yet read)."""

    IN_FLIGHT = 2

    def __init__(self, sim: Sim, gpu: Gpu, costs: DeviceCosts, *, buckets: Sequence[int], k_max: int,
                 seed: int = 0) -> None:
        costs.check_talker_buckets(buckets)
        self.sim, self.gpu, self.costs = sim, gpu, costs
        self.buckets, self.k_max = sorted(set(buckets)), k_max
        self.num_codebooks = NUM_CODEBOOKS
        rng = np.random.default_rng(seed)
        self._codes = rng.integers(0, CODEBOOK_SIZE, (k_max, self.buckets[-1], NUM_CODEBOOKS + 1),
                                   dtype=np.int32)
        self._codes[..., NUM_CODEBOOKS] = 0  # no stop frame
        self.prefills: list[tuple[int, int]] = []   # (rows, tokens) of each call
        self.graphed_prefills = 0                   # of them, asynchronous (rows carrying tokens)
        self.steps: list[tuple[int, int]] = []      # (bucket, k) of each decode
        self._uncollected: list[StepHandle] = []

    def bucket_for(self, rows: int) -> int:
        for bucket in self.buckets:
            if bucket >= rows:
                return bucket
        raise ValueError(f"{rows} rows exceed the largest bucket {self.buckets[-1]}")

    def prefill(self, rows) -> None:
        """Rows carrying ``tokens`` (a chunk of the packed prompt) are the graphed, asynchronous
        prefill (``_prefill_graphed``); rows carrying ``segments`` are today's eager one
        (``_prefill_eager``), modeled as before so today's loop simulates as it did."""
        if not rows:
            raise ValueError("prefill needs one or more rows")
        graphed = [getattr(r, "tokens", None) is not None for r in rows]
        if any(graphed) and not all(graphed):
            raise ValueError("prefill rows mix tokens and segments: every row carries one kind")
        if all(graphed):
            self._prefill_graphed(rows)
        else:
            self._prefill_eager(rows)

    def _prefill_eager(self, rows) -> None:
        """Eager prefill. It is synchronous, not queued: each prompt's token ids reach the
        device by a copy from pageable memory (``prompt_embeds``' ``torch.as_tensor(...,
        device=)``), which waits for the stream. So the engine thread is held for the call's
        whole measured time (``steps_gpu.py`` timed it with events around the call), which
        the talker's queue on the GPU also takes."""
        tokens = max(prompt_tokens(r.segments) for r in rows)
        lane = self.sim.current
        lane.sync()
        job = self.gpu.submit("talker", self.costs.prefill_ms(len(rows), tokens) / 1e3, lane.now())
        lane.ops(self.costs.prefill_ops(len(rows)), self.costs.prefill_host_ms(len(rows), tokens) / 1e3)
        lane.wait_job(job)
        self.prefills.append((len(rows), tokens))

    def _prefill_graphed(self, rows) -> None:
        """The new prefill: one staged copy from pinned memory and a graph replay per (rows,
        prompt-length) bucket, queued on the talker's stream ahead of the next decode step and
        never waited for (nothing syncs the host). A row's positions are its chunk's
        ``len(tokens)``; the call is padded to the longest (the bucket set is the runner's
        choice, so padding to it is not modeled). Its device time is rule graphed_prefill's
        estimate; the host pays only the launch and staging ops."""
        for r in rows:
            if len(r.tokens) < 1:
                raise ValueError(f"prefill row for slot {r.slot}: tokens must hold one or more positions")
        tokens = max(len(r.tokens) for r in rows)
        lane = self.sim.current
        lane.sync()
        self.gpu.submit("talker", self.costs.prefill_graphed_ms(len(rows), tokens) / 1e3, lane.now())
        host_s = self.costs.prefill_graphed_host_ms(len(rows)) / 1e3
        lane.ops(self.costs.prefill_graphed_ops(len(rows)), host_s)
        self.prefills.append((len(rows), tokens))
        self.graphed_prefills += 1

    def launch(self, slots: Sequence[int], k: int) -> StepHandle:
        """Queues a decode step of K frames (gathers, K replays, scatters, the async copy to a
        pinned buffer, an event) and returns at once; the host pays the launches."""
        if not 1 <= k <= self.k_max:
            raise ValueError(f"k must be in [1, {self.k_max}], got {k}")
        if len(self._uncollected) >= self.IN_FLIGHT:
            raise RuntimeError(f"launch: {self.IN_FLIGHT} steps are launched and not collected "
                               f"(the runner has {self.IN_FLIGHT} host result buffers)")
        bucket = self.bucket_for(len(slots))
        lane = self.sim.current
        lane.sync()
        job = self.gpu.submit("talker", self.costs.talker_step_ms(bucket, k) / 1e3, lane.now())
        lane.ops(self.costs.step_ops(k), self.costs.step_launch_ms(k) / 1e3)  # gathers, K replays, scatters
        self.steps.append((bucket, k))
        handle = StepHandle(job, len(slots), k)
        self._uncollected.append(handle)
        return handle

    def collect(self, handle: StepHandle) -> np.ndarray:
        """Waits for the step's event; its codes + stop flags, int32 [K, B, N + 1]."""
        if handle.collected or handle not in self._uncollected:
            raise RuntimeError("collect: this step was already collected or was not launched here")
        self.sim.current.wait_job(handle.job)
        handle.collected = True
        self._uncollected.remove(handle)
        return self._codes[: handle.k, : handle.rows].copy()

    def decode(self, slots: Sequence[int], k: int) -> np.ndarray:
        return self.collect(self.launch(slots, k))


class ModeledDecoder:
    """``services.code2wav.decoder.CodecDecoder``'s interface: reset(slots), decode_pcm(slots, codes),
    decode_many(slots, chunks) (chunks of different frame counts in one call, padded as the real
    decoder pads them: to the smallest graph's frames that fits, eagerly to the longest).

    ``free``: its calls take no device time and no host time (nothing is queued on the GPU, no
    launch is charged), the device half of the "Code2Wav free" option (the other half is its
    process's GIL at cpu_scale 0, ``run.build_stack``)."""

    def __init__(self, sim: Sim, gpu: Gpu, costs: DeviceCosts, *, graph_buckets: Sequence[int],
                 graph_chunk_frames: Sequence[int], cuda_graphs: bool, free: bool = False) -> None:
        self.sim, self.gpu, self.costs, self.free = sim, gpu, costs, free
        self.graph_buckets = sorted(graph_buckets) if cuda_graphs else []
        self.graph_frames = set(graph_chunk_frames) if cuda_graphs else set()
        self.codec = SimpleNamespace(num_codebooks=NUM_CODEBOOKS, config=SimpleNamespace(
            codebook_size=CODEBOOK_SIZE, frame_rate=FRAME_RATE, samples_per_frame=SAMPLES_PER_FRAME))
        self.calls: list[tuple[int, int, bool]] = []  # (rows, frames, graph)

    def reset(self, slots: Sequence[int]) -> None:
        """A few elementwise kernels on the state pool: queued, never waited for."""

    def _graph_bucket(self, rows: int, frames: int) -> int | None:
        if frames not in self.graph_frames:
            return None
        fits = [b for b in self.graph_buckets if b >= rows]
        return fits[0] if fits else None

    def decode_many(self, slots: Sequence[int], chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
        longest = max(len(chunk) for chunk in chunks)
        graphed = sorted(t for t in self.graph_frames if t >= longest)
        frames = graphed[0] if graphed else longest
        self._decode(len(chunks), frames)
        return [np.zeros(len(chunk) * SAMPLES_PER_FRAME, dtype=np.int16) for chunk in chunks]

    def decode_pcm(self, slots: Sequence[int], codes: np.ndarray) -> np.ndarray:
        rows, frames, _ = codes.shape
        self._decode(rows, frames)
        return np.zeros((rows, frames * SAMPLES_PER_FRAME), dtype=np.int16)

    def _decode(self, rows: int, frames: int) -> None:
        bucket = self._graph_bucket(rows, frames)
        graph = bucket is not None
        if self.free:
            self.calls.append((rows, frames, graph))
            return
        device_ms = (self.costs.codec_ms(bucket, frames, True) if graph
                     else self.costs.codec_ms(rows, frames, False))
        device_ms += self.costs.d2h_ms(rows * frames * SAMPLES_PER_FRAME * 2)
        lane = self.sim.current
        lane.sync()
        job = self.gpu.submit("codec", device_ms / 1e3, lane.now())
        lane.ops(self.costs.codec_ops(graph), self.costs.codec_host_ms(rows, frames, graph) / 1e3)
        lane.wait_job(job)
        self.calls.append((rows, frames, graph))
