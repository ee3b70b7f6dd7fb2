"""Voice reference clips as audio-context turns, encoded once per clip.

A voice may carry a reference clip (mono 16-bit WAV) and its transcript. The first
request with that voice sends the clip to ``Code2Wav.EncodeVoice`` (the gateway has no
codec) and caches the frames by the clip's content hash; the turn is the transcript in
the voice's speaker format followed by those frames.
"""

from __future__ import annotations

import hashlib
import wave

import grpc

from services.common.errors import Internal, Unavailable
from services.gateway.routing import EnginePair, ModelFacts
from services.gateway.voices import VoiceCatalog, VoiceEntry
from voxring.v1 import code2wav_pb2, common_pb2, talker_pb2


def read_wav(data: bytes, name: str) -> tuple[bytes, int]:
    import io

    try:
        with wave.open(io.BytesIO(data)) as clip:
            if clip.getnchannels() != 1 or clip.getsampwidth() != 2:
                raise Internal(f"voice clip {name}: needs mono 16-bit PCM WAV")
            return clip.readframes(clip.getnframes()), clip.getframerate()
    except (wave.Error, EOFError) as exc:
        raise Internal(f"voice clip {name}: unreadable WAV ({exc})") from None


class VoiceCache:
    def __init__(self, voices: VoiceCatalog) -> None:
        self.voices = voices
        self._frames: dict[str, common_pb2.Frames] = {}

    async def context(self, voice: VoiceEntry, facts: ModelFacts, pair: EnginePair) -> list:
        """The voice's audio-context turn, or no turn for a voice without a clip."""
        if voice.reference_audio is None:
            return []
        data = (self.voices.folder / voice.reference_audio).read_bytes()
        key = hashlib.sha256(data).hexdigest()
        frames = self._frames.get(key)
        if frames is None:
            pcm, rate = read_wav(data, voice.reference_audio)
            try:
                reply = await pair.code2wav.EncodeVoice(
                    code2wav_pb2.EncodeVoiceRequest(audio=pcm, sample_rate_hz=rate), timeout=30.0)
            except grpc.aio.AioRpcError as exc:
                raise Unavailable(f"encoding voice {voice.name}: {exc.details()}") from None
            frames = self._frames.setdefault(key, reply.frames)
        ids = facts.prompt_ids(voice.speaker_id, voice.reference_text or "")
        return [talker_pb2.PromptSegment(text_token_ids=ids, frames=frames)]
