"""What lets the simulator drive an older tree's talker too, so that a serving-loop change's
"before" tables come from the same simulator version as its "after" ones: keyword arguments an
older signature lacks are dropped, and what an older tree lacks is imported only when used."""

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
