"""The SMs of one GPU split between the stages by CUDA green contexts (``model.sm_split``): the
talker's kernels on a group of the device's SMs (``group:N``), Code2Wav's on the remainder
(``rest:N``, the same N), so that neither waits for SMs the other's kernels hold. Both stages stay
MPS clients with no active-thread limit (a limit breaks the talker's library ops; a green context
of fewer SMs does not: bench notes 2026-12-05, ninth session). Experimental: off by default until
the server bench measures the pair with it.

The spec and the binding of threads live here (no torch); the green context itself is
kernels/green.py's, which a stage passes in (``enter_configured``). A stage enters its part before
its model loads, and every engine thread binds it first (``bind_this_thread``, at its start).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from services.common.config import ConfigError

PARTS = ("group", "rest")
_SPEC = re.compile(r"(?P<part>[a-z]+):(?P<sms>\d+)")


@dataclass(frozen=True)
class SmSplit:
    part: str        # "group": the first N SMs of the split; "rest": the remainder
    group_sms: int   # N: the group's SMs (the driver may round it up to its granularity)

    @classmethod
    def parse(cls, text: str | None) -> SmSplit | None:
        """``group:N`` or ``rest:N``; None or "" for no split. Raises ValueError saying why."""
        if not text:
            return None
        found = _SPEC.fullmatch(text.strip())
        if found is None or found["part"] not in PARTS:
            raise ValueError(f"must be group:N or rest:N (N the talker's SMs), got {text!r}")
        sms = int(found["sms"])
        if sms < 1:
            raise ValueError(f"the group needs at least one SM, got {text!r}")
        return cls(found["part"], sms)


_part = None  # the entered part: .bind() and .sms (kernels/green.py's GreenPart)


def enter_configured(text: str | None, device, enter: Callable) -> object | None:
    """A stage's ``model.sm_split`` entered by ``enter(part, group_sms, device)`` (kernels.green.enter),
    its failure a ConfigError naming the key; None without a split."""
    global _part
    try:
        split = SmSplit.parse(text)
    except ValueError as exc:
        raise ConfigError(f"model.sm_split: {exc}") from None
    if split is None:
        return None
    try:
        _part = enter(split.part, split.group_sms, device)
    except RuntimeError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("model.sm_split") else f"model.sm_split: {message}") \
            from None
    return _part


def bind_this_thread() -> None:
    """The engine thread's first call: its launches go to the process's part (none: nothing)."""
    if _part is not None:
        _part.bind()


def metrics() -> dict:
    return {"sm_split_sms": ("gauge", "SMs of this stage's part of its GPU (model.sm_split; 0: no split)",
                             _part.sms if _part is not None else 0)}
