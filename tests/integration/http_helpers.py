"""Helpers of the HTTP API's integration tests (test_http_api.py, test_http_websocket.py):
the engine pair's configs, certificates, decoders independent of the gateway's encoders, raw
HTTP on a socket, metrics and a reference clip."""

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


def pair_configs(d: Path) -> dict[str, str]:
    """The engine pair of a test stack: a talker and a Code2Wav attached to it, on unix sockets in
    ``d`` (the folder's name short: socket paths are bounded), where the gateways route to them
    (test_http_api._gateway_config)."""
    return {
        "talker": f"server: {{listen: 'unix:{d}/talker.sock', drain_timeout: 5, grace: 1}}\n"
                  f"engine: {{k_max: 4, buckets: [1, 2, 4, 8], max_num_seqs: 8, max_len: 512}}\n",
        "code2wav": f"server: {{listen: 'unix:{d}/code2wav.sock', drain_timeout: 5, grace: 1}}\n"
                    f"engine: {{max_slots: 8}}\n"
                    f"talkers: {{attach: [{{id: talker-0, address: 'unix:{d}/talker.sock'}}]}}\n",
    }


def start_stages(stages, configs: dict[str, str]) -> dict[str, dict]:
    """Starts each config of ``configs`` in a StageGroup (tests/conftest.py), in order, each ready
    before the next; a name's part before '-' is its stage ("gateway-tls": a gateway). Returns
    each one's ready file (its addresses: "http", "metrics", ...)."""
    return {name: stages.start(name.partition("-")[0], config, name=name, timeout=60).ready()
            for name, config in configs.items()}


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
