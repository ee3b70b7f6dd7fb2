"""The gateway's OpenAI-compatible HTTP API (``POST /v1/audio/speech`` and friends) and its
playground page, served beside the gRPC API in the same event loop (server.HttpServer)."""

from __future__ import annotations

from pathlib import Path

from services.common.auth import read_token_file
from services.gateway.config import GatewayConfig
from services.gateway.http.app import ApiParts
from services.gateway.http.server import HttpServer
from services.gateway.pipeline import SynthesisPipeline
from services.gateway.servicer import SynthesizerServicer

__all__ = ["ApiParts", "HttpServer", "http_components"]


def http_components(config: GatewayConfig, base: Path, servicer: SynthesizerServicer,
                    pipeline: SynthesisPipeline) -> list[HttpServer]:
    """The HTTP server component, or none when ``http.listen`` is null. ``base``: the config
    file's folder (auth.token_file is relative to it, as for gRPC)."""
    if config.http.listen is None:
        return []
    token = None
    if config.auth.token_file is not None:
        token = read_token_file(base / config.auth.token_file, "auth.token_file")
    return [HttpServer(config, ApiParts(config, servicer, pipeline), token)]
