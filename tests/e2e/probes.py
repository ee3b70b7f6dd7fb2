"""The stage processes read from outside for the fault and load tests: bounded waits
for a condition, open fds, RSS and the voxring entries in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable

import grpc

from services.transport.shm_sweep import list_entries


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition",
             interval: float = 0.02) -> float:
    """Polls until ``predicate()``; the seconds it took. Bounded."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        with contextlib.suppress(grpc.RpcError):
            if predicate():
                return time.monotonic() - started
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout} s")
        time.sleep(interval)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> dict[str, int]:
    """Open fds by kind (socket, anon_inode, /dev/shm/..., a file): for failure messages."""
    kinds: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kinds[target.split(":[")[0] if ":[" in target else target] += 1
    return dict(kinds)


def shm_entries() -> set[str]:
    return set(list_entries())
