"""The audio package's client-facing error, in a module of its own so that every stage
(pcm, tempo, the codecs) can raise it without importing each other."""

from __future__ import annotations


class AudioParamError(ValueError):
    """A client-chosen audio parameter is unusable; ``field`` names the request field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
