"""Finding and removing this project's ring segments in /dev/shm.

Only talkers sweep, at start-up (docs/protocol.md, Rings): :func:`sweep_stale` removes
``voxring-ring-*`` segments (and their ``sem.voxring-wake-*`` semaphores) whose producer
heartbeat is older than the liveness timeout, or whose control block is unreadable, and
semaphores left without a ring. ``voxring`` is the default name prefix
(layout.shm_prefix): only entries of this process's prefix are ever looked at, so a
stack (or test run) with its own prefix is invisible to every other one's sweep. A live
producer stores its heartbeat at least every 100 ms, so its ring is never removed.
Entries younger than the timeout are never judged unreadable (a producer may be between
creating a segment and writing its header), and entries of other users are left alone.

Reads go through a read-only mmap with aligned 8-byte loads (see layout.py), after
checking the file is large enough, so a short or garbage file cannot fault the reader.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from pathlib import Path

import posix_ipc

from services.transport.layout import (
    HEADER_BYTES,
    LAYOUT_VERSION,
    MAGIC,
    OFF_MAGIC,
    OFF_PRODUCER_HB,
    OFF_VERSION,
    SEM_FILE_PREFIX,
    shm_file_prefixes,
    wake_name_for,
)

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def list_entries() -> list[str]:
    """File names of every ring and wake-up semaphore of this process's name prefix
    (layout.shm_prefix) in /dev/shm, sorted; other prefixes' entries are never listed."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(shm_file_prefixes()))


def producer_heartbeat_age(ring_file: Path) -> float | None:
    """Seconds since the ring's producer heartbeat; None when the control block is
    unreadable (too short, bad magic or layout). Raises OSError when it cannot be opened."""
    fd = os.open(ring_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < HEADER_BYTES:
            return None
        with mmap.mmap(fd, HEADER_BYTES, prot=mmap.PROT_READ) as mm, memoryview(mm) as whole:
            ctl = whole.cast("Q")
            try:
                if ctl[OFF_MAGIC // 8] != MAGIC or ctl[OFF_VERSION // 8] != LAYOUT_VERSION:
                    return None
                heartbeat = ctl[OFF_PRODUCER_HB // 8]
            finally:
                ctl.release()
    finally:
        os.close(fd)
    return (time.monotonic_ns() - heartbeat) / 1e9


def _is_stale_ring(path: Path, liveness_timeout: float) -> bool:
    try:
        st = path.lstat()
        if st.st_uid != os.getuid():
            return False
        age = producer_heartbeat_age(path)
    except OSError:
        return False  # gone meanwhile, or not ours to judge
    if age is None:  # unreadable: only once old enough not to be a ring being created
        return time.time() - st.st_mtime > liveness_timeout
    return age > liveness_timeout


def unlink_ring(ring_file_name: str) -> None:
    """Removes a ring segment and its semaphore by /dev/shm file name; idempotent."""
    name = "/" + ring_file_name.removeprefix("/")
    wake_name = wake_name_for(name)
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_semaphore(wake_name)


def _unlink_semaphore_file(sem_file_name: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_semaphore("/" + sem_file_name.removeprefix(SEM_FILE_PREFIX))


def sweep_stale(liveness_timeout: float) -> list[str]:
    """Removes stale rings and orphaned semaphores of this process's name prefix; returns
    the file names removed."""
    removed: list[str] = []
    ring_prefix, sem_file_prefix = shm_file_prefixes()
    entries = list_entries()
    rings = {n.removeprefix(ring_prefix) for n in entries if n.startswith(ring_prefix)}
    for suffix in sorted(rings):
        name = ring_prefix + suffix
        if _is_stale_ring(SHM_DIR / name, liveness_timeout):
            unlink_ring(name)
            removed.append(name)
            if sem_file_prefix + suffix in entries:
                removed.append(sem_file_prefix + suffix)
    for entry in entries:
        if not entry.startswith(sem_file_prefix) or entry.removeprefix(sem_file_prefix) in rings:
            continue
        with contextlib.suppress(OSError):
            st = (SHM_DIR / entry).lstat()
            if st.st_uid == os.getuid() and time.time() - st.st_mtime > liveness_timeout:
                _unlink_semaphore_file(entry)
                removed.append(entry)
    if removed:
        log.info("swept %d stale ring entr%s: %s", len(removed), "y" if len(removed) == 1 else "ies",
                 ", ".join(removed))
    return removed
