"""Which process a pid names, and stopping it: the stack's stages are recorded by pid, and a pid
may be given to another process once its own has ended."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path


def is_stage_process(pid: int, stage: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return f"services.{stage}".encode() in cmdline


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, field 22): with the pid, it names one
    process, whatever the pid is given to later; None when it is gone."""
    stat = _stat(pid)
    return None if stat is None else stat[19]


def is_same_live_process(pid: int, started: str | None) -> bool:
    """Whether the process that started at ``started`` still runs (a zombie has ended)."""
    stat = _stat(pid)
    return started is not None and stat is not None and stat[19] == started and stat[0] != "Z"


def terminate(pid: int, timeout: float, alive: Callable[[], bool]) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; True when it stopped gracefully."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return False
