"""One request of bench.gateway.cpu over each public API: gRPC ``SynthesizeOnline`` through the
SDK, HTTP ``POST /v1/audio/speech`` streamed as audio, the same as SSE events; and a response's
duration as FFmpeg decodes it (the check that the bytes measured were the audio asked for)."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass

import httpx2 as httpx  # the HTTP client the installed openai package is built on (as the tests)

SDK_ENCODING = {"pcm": "pcm", "wav": "wav", "opus": "ogg_opus", "mp3": "mp3", "aac": "aac", "flac": "flac"}
TEXT = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill, "
        "and the children count the boats that sail down toward the harbour before the evening.")
SEED = 7
AUDIO_S = 4.0         # max_audio_seconds of every request
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Case:
    api: str
    fmt: str
    speed: float = 1.0

    @property
    def key(self) -> str:
        return f"{self.api}/{self.fmt}" + ("" if self.speed == 1.0 else f"@{self.speed:g}")


class Apis:
    """The SDK client and the HTTP client, and what the HTTP answers cannot say themselves: the
    reference request's audio seconds and the model's frame rate (from its usage)."""

    def __init__(self, grpc_target: str, http_address: str) -> None:
        from voxring.client import Client  # grpc: only once Stack.up has spawned the stages

        self.sdk = Client(grpc_target, timeout=REQUEST_TIMEOUT_S)
        self.http = httpx.Client(base_url=f"http://{http_address}", timeout=REQUEST_TIMEOUT_S)
        self.reference_audio_s, self.frame_rate = AUDIO_S, 0.0  # until reference() asked

    def reference(self) -> dict:
        """One gRPC PCM request of the fixed text and seed: the audio seconds and frame rate."""
        ref = self.grpc(Case("grpc", "pcm"))
        self.reference_audio_s, self.frame_rate = ref["audio_s"], ref["frames"] / ref["audio_s"]
        return {"audio_s": ref["audio_s"], "frames": ref["frames"], "finish": ref["finish"],
                "frame_rate": round(self.frame_rate, 4)}

    def close(self) -> None:
        self.sdk.close()
        self.http.close()

    def request(self, case: Case) -> dict:
        return self.grpc(case) if case.api == "grpc" else self.speech(case)

    def grpc(self, case: Case) -> dict:
        stream = self.sdk.stream(TEXT, encoding=SDK_ENCODING[case.fmt], seed=SEED, max_audio_seconds=AUDIO_S,
                                 speed=case.speed)
        parts, rate = [], 0
        for chunk in stream:
            parts.append(chunk.audio)
            rate = chunk.sample_rate_hz
        usage = stream.result.usage
        return {"audio_s": usage.audio_seconds, "frames": usage.frames, "messages": len(parts),
                "bytes": sum(map(len, parts)), "finish": stream.result.finish_reason, "data": parts,
                "rate": rate}

    def speech(self, case: Case) -> dict:
        body = {"model": "tts-1", "input": TEXT, "voice": "default", "response_format": case.fmt,
                "speed": case.speed, "stream_format": "sse" if case.api == "sse" else "audio",
                "seed": SEED, "max_audio_seconds": AUDIO_S}
        with self.http.stream("POST", "/v1/audio/speech", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{case.key}: HTTP {response.status_code}: {response.read()[:300]!r}")
            rate = int(response.headers.get("x-sample-rate", 0))
            if case.api == "sse":
                return {**self._events(response, case), "rate": rate}
            parts = list(response.iter_raw())
        return {"audio_s": self.reference_audio_s, "frames": None, "messages": len(parts),
                "bytes": sum(map(len, parts)), "finish": None, "data": parts, "rate": rate}

    def _events(self, response, case: Case) -> dict:
        parts, done = [], None
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "speech.audio.delta":
                parts.append(base64.b64decode(event["audio"]))
            elif event["type"] == "speech.audio.done":
                done = event
            else:
                raise RuntimeError(f"{case.key}: SSE event {event!r}")
        if done is None:
            raise RuntimeError(f"{case.key}: the SSE stream ended without speech.audio.done")
        frames = done["usage"]["output_tokens"]
        return {"audio_s": frames / self.frame_rate, "frames": frames, "messages": len(parts),
                "bytes": sum(map(len, parts)), "finish": None, "data": parts}


def decoded_s(fmt: str, data: bytes, rate: int) -> float | str:
    """The response's duration as FFmpeg decodes it (PCM: its length); an error's text."""
    if fmt == "pcm":
        return round(len(data) / 2 / rate, 3)
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            samples = sum(frame.samples for frame in container.decode(stream))
            return round(samples / stream.codec_context.sample_rate, 3)
    except (av.FFmpegError, IndexError, ZeroDivisionError) as exc:
        return f"{type(exc).__name__}: {exc}"

