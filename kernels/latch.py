"""The process-level fallback latch that stands between a Triton kernel and its eager twin.

One ``KernelLatch`` per kernel; each drop-in routes its calls through ``KernelLatch.dispatch`` (the twin
for tensors off the kernel's device and for inputs the kernel does not take, else ``call``). Two ways
to the twin besides those:

* **configured off** (``enabled = False``): a strict switch for triage; the twin serves every call
  and nothing is logged;
* **tripped**: the first call whose kernel raises (a compile error, a launch failure, a missing
  backend), or a failure its caller finds afterwards (``trip``: a fault flag read back), logs one
  warning with the exception and the twin serves every later call for the rest of the process. A
  kernel that failed once is never retried: retrying on every call would pay the failure (and its
  log line) per frame.

Compilation happens on the first call with a new specialisation, so run one eager warm-up before
capturing a CUDA graph: a failure then trips the latch outside the capture and the graph records
the twin.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class KernelLatch:
    """Routes calls to a kernel or to its eager twin; see the module docstring for the rules."""

    def __init__(self, name: str, enabled: bool = True) -> None:
        self.name = name
        self._enabled = _strict_bool(name, enabled)
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """The configured switch (True unless turned off for triage)."""
        return self._enabled

    @property
    def failure(self) -> BaseException | None:
        """The exception that tripped the latch, or None."""
        return self._failure

    @property
    def active(self) -> bool:
        """True when the next call goes to the kernel."""
        return self._enabled and self._failure is None

    def configure(self, enabled: bool) -> None:
        """Sets the switch; only a real bool is accepted (no truthy strings or ints)."""
        self._enabled = _strict_bool(self.name, enabled)

    def reset(self) -> None:
        """Forgets a trip (tests only: in service the latch stays tripped for the process)."""
        with self._lock:
            self._failure = None

    def call(self, kernel: Callable[P, R], twin: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """kernel(*args, **kwargs) while active; the twin when off, tripped, or the kernel raises."""
        if not self.active:
            return twin(*args, **kwargs)
        try:
            return kernel(*args, **kwargs)
        except Exception as exc:  # compile / launch failures of any kind: the twin takes over
            self._trip(exc)
        return twin(*args, **kwargs)

    def dispatch(self, on_device: bool, check: Callable[[], object], kernel: Callable[P, R],
                 twin: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """A drop-in's one rule: the twin for tensors off the kernel's device (``on_device`` False) and
        for inputs ``check`` refuses with ValueError (the twin takes what the kernel cannot, and the latch
        stays as it is), else ``call``."""
        if not on_device:
            return twin(*args, **kwargs)
        try:
            check()
        except ValueError:
            return twin(*args, **kwargs)
        return self.call(kernel, twin, *args, **kwargs)

    def trip(self, exc: Exception) -> None:
        """Trips the latch for a failure found after the kernel returned (its results are already
        wrong: the caller discards them); the first trip is logged, later ones are not."""
        self._trip(exc)

    def _trip(self, exc: Exception) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = exc
        if first:
            log.warning("kernel %s failed; its eager twin serves the rest of this process",
                        self.name, exc_info=exc)


def _strict_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"kernels.{name}: enabled must be a bool, got {value!r}")
    return value
