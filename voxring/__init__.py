"""voxring's client side: the SDK (:mod:`voxring.client`) and the ``voxring`` command.

``voxring.FLUSH`` and ``voxring.CLEAR`` are the markers a ``stream_text`` piece may be
(:mod:`voxring.sessions`). They load on first use: the CLI imports this package before
``up`` spawns processes, and a process must not fork after importing grpc.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CLEAR", "FLUSH"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from voxring import sessions

        return getattr(sessions, name)
    raise AttributeError(f"module 'voxring' has no attribute {name!r}")
