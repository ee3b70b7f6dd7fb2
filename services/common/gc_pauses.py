"""How long a stage process's garbage collections stop it: every collection (``gc.callbacks``,
start to stop) as the histogram ``gc_pause_seconds``, and the full ones (the oldest generation,
which walks every live object) as ``gc_full_pause_seconds``. A collection holds the GIL: the
gateway's one event loop, and every request and stream it carries, waits for it; so does an
engine's step.

``freeze_startup`` moves what the stage built before serving (its modules, the model's objects,
its graphs) out of the collector's reach (``gc.freeze``): a full collection then walks only what
serving made, tens of thousands of objects fewer (a talker's imports alone are ~200k, a full
collection of them tens of ms)."""

from __future__ import annotations

import gc
import time

from services.common.histogram import EdgeHistogram

EDGES = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
OLDEST = 2  # gc.collect()'s generation that walks everything


class GcPauses:
    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.pause = EdgeHistogram(EDGES)
        self.full = EdgeHistogram(EDGES)
        self._began: float | None = None

    def install(self) -> GcPauses:
        if self._on not in gc.callbacks:
            gc.callbacks.append(self._on)
        return self

    def uninstall(self) -> None:
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)

    def _on(self, phase: str, info: dict) -> None:
        # runs with the GIL held, on whichever thread the collection stopped: no lock needed
        if phase == "start":
            self._began = self.clock()
            return
        if self._began is None:
            return
        took, self._began = self.clock() - self._began, None
        self.pause.observe_one(took)  # cheap: a young collection runs every few hundred allocations
        if info.get("generation") == OLDEST:
            self.full.observe_one(took)

    def metrics(self) -> dict:
        return {"gc_frozen_objects": ("gauge", "objects built before serving, left out of every collection",
                                      gc.get_freeze_count()),
                "gc_pause_seconds": ("histogram", "how long each garbage collection stopped this process",
                                     self.pause.metric()),
                "gc_full_pause_seconds": ("histogram", "the same, for full collections (every live object)",
                                          self.full.metric())}


def freeze_startup() -> int:
    """What was built so far goes to the permanent generation (collected first: garbage is not
    kept); how many objects it holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
