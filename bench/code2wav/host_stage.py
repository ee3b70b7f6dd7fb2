"""Code2Wav's whole process (config, rings, engine thread, gRPC server) with a decoder that
returns at once, for bench/code2wav/host.py:

    python -m bench.code2wav.host_stage --config PATH --ready-file PATH

:class:`InstantDecoder` keeps the host's share of a real decode call: the chunk checks,
the padded int64 batch and its tensor, and one copy of the call's PCM into host memory
(what the device-to-host copy into pageable memory costs the host on a GPU); the codec
itself (and the PCM conversion, device work on a GPU) is skipped. Slot resets stay real.
Python threads get their names as OS thread names (``/proc/PID/task/*/comm``), so the
driver can tell the engine thread from the event loop's.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from collections.abc import Sequence

import numpy as np
import torch

import services.code2wav.__main__ as stage
from models.mimi.model import CodecInputError
from services.code2wav.config import Code2WavConfig
from services.code2wav.decoder import CodecDecoder, _chunk_frames
from services.common.stage import run_stage


class InstantDecoder(CodecDecoder):
    def decode_many(self, slots: Sequence[int], chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(chunks) != len(slots):
            raise CodecInputError(f"{len(chunks)} chunks for {len(slots)} slots")
        if not chunks:
            return []
        frames = _chunk_frames(chunks)
        padded = np.zeros((len(chunks), max(frames), chunks[0].shape[1]), np.int64)
        for row, chunk in enumerate(chunks):
            padded[row, : len(chunk)] = chunk
        torch.from_numpy(padded).transpose(1, 2)  # the batch a real call hands the device
        spf = self.codec.config.samples_per_frame
        pcm = np.zeros((len(chunks), max(frames) * spf), np.int16)  # the call's copy to the host
        return [pcm[row, : t * spf] for row, t in enumerate(frames)]


def _os_name(name: str) -> None:
    """prctl(PR_SET_NAME): the calling thread's name in /proc (15 bytes)."""
    ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)


def _named_threads() -> None:
    start = threading.Thread.run

    def run(self) -> None:
        _os_name(self.name)
        start(self)

    threading.Thread.run = run
    _os_name("main-loop")


def _die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGTERM): a driver that dies takes this stage down with it."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)


if __name__ == "__main__":
    _die_with_parent()
    _named_threads()
    stage.CodecDecoder = InstantDecoder  # build() makes its decoder from this name
    sys.exit(run_stage("code2wav", Code2WavConfig, stage.build))
