"""A server component whose work is one coroutine in the server's event loop.

:class:`LoopTask` is started by the :class:`~services.common.server.ServiceHost` inside
its loop (``start``) and stopped after the drain from a worker thread (``stop``), or
from the loop itself; a subclass writes :meth:`run`. The task's unexpected end is
logged, never silent.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


class LoopTask:
    name = "loop task"  # for the log lines

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self.stopping = False

    async def run(self) -> None:  # the subclass's work, until ``stopping`` or cancelled
        raise NotImplementedError

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self.run(), name=self.name)
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s stopped", self.name, exc_info=task.exception())

    async def aclose(self) -> None:
        self.stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})

    def stop(self, timeout: float) -> None:
        """Ends the task; waits up to ``timeout`` s when called from another thread."""
        if self._task is None or self._loop is None or self._loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.stopping = True
            self._task.cancel()
            return
        future = asyncio.run_coroutine_threadsafe(self.aclose(), self._loop)
        try:
            future.result(timeout)
        except TimeoutError:
            log.warning("%s did not stop within %.1f s", self.name, timeout)
