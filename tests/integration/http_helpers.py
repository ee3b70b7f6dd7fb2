"""Helpers of tests/integration/test_http_api.py: certificates, decoders independent of the
gateway's encoders, raw HTTP on a socket, metrics and a reference clip."""

from __future__ import annotations

import io
import socket
import urllib.request
from pathlib import Path

import av
import httpx2 as httpx
import numpy as np
import soundfile
import trustme

RATE = 24000   # voxring-tiny's sample rate
WAIT_S = 30.0  # bound on every call to the stack


def write_pki(folder: Path) -> dict[str, Path]:
    """A throwaway CA (trustme) and a server certificate for localhost and 127.0.0.1."""
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    paths = {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    paths["cert"].write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    return paths


def decode_av(data: bytes) -> tuple[int, int, str]:
    """(samples, rate, codec) through FFmpeg's demuxer and decoder."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples, stream.codec_context.sample_rate, stream.codec_context.name


def read_to_end(data: bytes) -> tuple[np.ndarray, int]:
    """libsndfile's decode, block by block to the end: a streamed file's header has no length.
    Through sf_readf_short itself: pysoundfile's read() seeks after every block, which
    libsndfile's FLAC reader cannot do in a stream whose STREAMINFO leaves the length unset."""
    with soundfile.SoundFile(io.BytesIO(data)) as sound:
        blocks, block = [], np.empty(65536, np.int16)
        pointer = soundfile._ffi.cast("short *", block.ctypes.data)
        while n := soundfile._snd.sf_readf_short(sound._file, pointer, len(block)):
            blocks.append(block[:n].copy())
        return np.concatenate(blocks), sound.samplerate


def read_response_head(sock: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(65536)
        if not data:
            break
        head += data
    return head


def metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=WAIT_S).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


def clip_wav(seconds: float = 2.0) -> bytes:
    t = np.arange(int(seconds * RATE)) / RATE
    tone = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, tone, RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


def refused_or_closed(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/models", timeout=5).status_code == 503
    except httpx.TransportError:
        return True
