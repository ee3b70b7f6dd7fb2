"""What lets the simulator drive an older tree's stages too, so that a serving-loop change's
"before" tables come from the same simulator version as its "after" ones: keyword arguments an
older signature lacks are dropped, what an older tree lacks is imported only when used, and a
tree whose gateway still chooses a chunk schedule (before Code2Wav cut chunks on need) gets it
sent to both stages as its gateway did."""

from __future__ import annotations

import inspect

# the talker's pacing and admission settings (EngineSection), where the tree has them
PACING_KEYS = ("path_s", "min_chunk_tokens", "admission_headroom", "max_queue_wait_s")


def supported(factory, **kwargs):
    """``factory(**kwargs)`` without the keywords its signature does not take."""
    params = inspect.signature(factory).parameters
    return factory(**{key: value for key, value in kwargs.items() if key in params})


def pack_prompt(segments, num_codebooks: int, eos_id: int):
    """The family's packed prompt (only a tree whose ModelFacts asks for it calls this)."""
    from models.csm.model import pack_prompt as pack

    return pack(segments, num_codebooks, eos_id)


def overloaded(refusal):
    """The servicer's ResourceExhausted for a scheduler refusal (a tree with early refusals)."""
    from services.talker.core import overloaded as convert

    return convert(refusal)


def has_field(message_class, name: str) -> bool:
    """Whether this tree's protobuf message has the field ``name``."""
    return name in message_class.DESCRIPTOR.fields_by_name


def stream_pacing(c2w_config):
    """Code2Wav's default pacing (a tree with ``pacing``) or chunk schedule (an older one)."""
    return getattr(c2w_config, "pacing", None) or c2w_config.chunks


def requested_pacing(request, default):
    """What an Open asks of Code2Wav: its pacing, or in an older tree its chunk schedule."""
    try:
        from services.code2wav.pacing import requested_pacing as requested
    except ImportError:
        from services.common.chunks import requested_schedule

        return requested_schedule(request) or default
    return requested(request, default)


def build_request(submit, facts, default_schedule, now: float, *budget):
    """The talker servicer's build_request (an older one also takes the default chunk schedule)."""
    from services.talker.servicer import build_request as build

    if "default_schedule" in inspect.signature(build).parameters:
        return build(submit, facts, default_schedule, now, *budget)
    return build(submit, facts, now, *budget)


def gateway_schedule(gateway, pair):
    """The chunk schedule an older gateway chose for a request (None: Code2Wav cuts on need)."""
    if not hasattr(gateway.config, "chunks"):
        return None
    from services.gateway.pipeline import SynthesisPipeline

    return SynthesisPipeline._schedule(gateway, pair)
