"""Voice reference clips as audio-context turns, encoded once per clip.

A voice may carry a reference clip (mono 16-bit WAV) and its transcript. The clip goes to
``Code2Wav.EncodeVoice`` (the gateway has no codec) once: a voices-file voice's frames
are cached here by the clip's content hash, on its first request; an added voice keeps
its frames in its own entry (:class:`~services.gateway.voices.ClipFrames`), encoded
when it was added (or on its first request after a restart), so they go away with the
voice. The turn is the transcript in the voice's speaker format followed by the frames.
"""

from __future__ import annotations

import hashlib
import io
import logging
import wave

import grpc

from services.common.errors import Internal, InvalidArgument, Unavailable
from services.common.rich_status import error_info
from services.gateway.routing import EnginePair, ModelFacts
from services.gateway.voices import UploadedVoice, VoiceCatalog, VoiceEntry
from voxring.v1 import code2wav_pb2, common_pb2, talker_pb2

log = logging.getLogger(__name__)

ENCODE_TIMEOUT_S = 30.0


def read_wav(data: bytes, name: str) -> tuple[bytes, int]:
    """(int16 LE mono PCM, rate) of a stored clip; Internal for anything else (the server's
    own file is wrong, not the request)."""
    try:
        with wave.open(io.BytesIO(data)) as clip:
            if clip.getnchannels() != 1 or clip.getsampwidth() != 2:
                raise Internal(f"voice clip {name}: needs mono 16-bit PCM WAV")
            return clip.readframes(clip.getnframes()), clip.getframerate()
    except (wave.Error, EOFError) as exc:
        raise Internal(f"voice clip {name}: unreadable WAV ({exc})") from None


async def encode_clip(pair: EnginePair, pcm: bytes, rate: int, name: str) -> common_pb2.Frames:
    """The codec frames of int16 mono ``pcm`` at ``rate``, from ``pair``'s Code2Wav. A clip
    Code2Wav refuses is InvalidArgument naming its field; a Code2Wav that cannot answer is
    Unavailable (another pair may)."""
    try:
        reply = await pair.code2wav.EncodeVoice(
            code2wav_pb2.EncodeVoiceRequest(audio=pcm, sample_rate_hz=rate), timeout=ENCODE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            field, _, reason = (exc.details() or "").partition(": ")
            raise InvalidArgument(field or "audio", reason or "refused by the codec") from None
        log.warning("encoding voice %s on engine pair %s: Code2Wav answered %s: %s", name, pair.name,
                    exc.code().name, exc.details())
        ours = error_info(exc.trailing_metadata()) is not None  # not the transport's (addresses)
        raise Unavailable(f"Code2Wav could not encode voice {name} ({pair.label})"
                          + (f": {exc.details()}" if ours else "")) from None
    return reply.frames


class VoiceCache:
    def __init__(self, voices: VoiceCatalog) -> None:
        self.voices = voices
        self._frames: dict[str, common_pb2.Frames] = {}

    async def context(self, voice: VoiceEntry, facts: ModelFacts, pair: EnginePair) -> list:
        """The voice's audio-context turn, or no turn for a voice without a clip."""
        if voice.reference_audio is None:
            return []
        try:
            if isinstance(voice, UploadedVoice):
                frames = await self._uploaded_frames(voice, pair)
            else:
                frames = await self._file_frames(voice, pair)
        except InvalidArgument as exc:  # the server's own clip, not the request, is at fault
            raise Internal(f"voice {voice.name}: Code2Wav refused its clip ({exc.message})") from None
        ids = facts.prompt_ids(voice.speaker_id, voice.reference_text or "")
        return [talker_pb2.PromptSegment(text_token_ids=ids, frames=frames)]

    async def _file_frames(self, voice: VoiceEntry, pair: EnginePair) -> common_pb2.Frames:
        data = (self.voices.folder / voice.reference_audio).read_bytes()
        key = hashlib.sha256(data).hexdigest()
        frames = self._frames.get(key)
        if frames is None:
            pcm, rate = read_wav(data, voice.reference_audio)
            frames = self._frames.setdefault(key, await encode_clip(pair, pcm, rate, voice.name))
        return frames

    @staticmethod
    async def _uploaded_frames(voice: UploadedVoice, pair: EnginePair) -> common_pb2.Frames:
        """Frames kept in the voice's entry; a voice loaded at start-up encodes its clip on
        first use (from the folder, or from memory when it was deleted since)."""
        slot = voice.clip
        if slot.frames is None:
            data = slot.wav
            if data is None:
                try:
                    with open(voice.reference_audio, "rb") as f:
                        data = f.read()
                except FileNotFoundError:
                    data = slot.wav  # deleted meanwhile: delete() kept it here first
                    if data is None:
                        raise Internal(f"voice {voice.name}: its clip {voice.reference_audio} "
                                       "is gone") from None
            pcm, rate = read_wav(data, voice.name)
            frames = await encode_clip(pair, pcm, rate, voice.name)
            if slot.frames is None:
                slot.frames = frames
        return slot.frames
