"""The bytes of a frame ring: control block, record header, names, errors, and why the
lock-free protocol is safe on x86-64 (docs/protocol.md, Rings).

A ring segment is ``HEADER_BYTES`` of control block followed by ``capacity`` bytes of
data. Every control field is an 8-byte-aligned little-endian uint64 (offsets below);
the producer's fields and the consumer's fields sit on different cache lines.

Records start at 16-byte-aligned offsets of the data area and occupy
``align16(length)`` bytes. A record that does not fit before the end of the data area
is preceded by a WRAP marker that fills the rest of it (only its first 6 bytes,
``length`` and ``record_type``, are meaningful; ``length`` equals the bytes to the
end), and is written at offset 0. ``head`` and ``tail`` count bytes ever published
and released; a record's offset is ``counter % capacity``.

Memory ordering. The producer stores the record (header, then payload) and only then
publishes it by storing ``head``; the consumer loads ``head`` and only then the record,
and releases records by storing ``tail`` after it is done reading them. x86-64 is TSO:
stores become visible in program order and loads are not reordered with other loads
or with later stores, so a consumer that sees the new ``head`` sees the whole record,
and the producer never reuses bytes the consumer may still read. Counters are written
and read with single aligned 8-byte accesses (a ``memoryview`` cast to ``"Q"``: CPython
packs an item with a fixed-size 8-byte memcpy, compiled to one ``mov``; aligned 8-byte
``mov``s are atomic on x86-64), never with ``struct``'s byte-by-byte ``"<Q"``. The one
pattern TSO does not order is a store followed by a load of another location (the
wake-up handshake: the consumer stores ``consumer_waiting`` then loads ``head``; the
producer stores ``head`` then loads ``consumer_waiting``); both sides put
:func:`full_fence` between the two. The GIL orders nothing across processes and is not
relied upon; nor can a compiler reorder across the opaque C calls (struct, memoryview,
numpy) that do the stores, which CPython makes in program order. Other architectures
are refused by :func:`require_x86_64`.

Nothing read from the segment is trusted: every offset and length is checked against
the capacity and the published head before memory is touched, and a violation raises
:class:`RingCorrupted` (the peer may be buggy, or the segment scribbled on).
"""

from __future__ import annotations

import enum
import os
import platform
import re
import struct
import threading
from typing import NamedTuple

import numpy as np

LAYOUT_VERSION = 1
MAGIC = int.from_bytes(b"voxring\x00", "little")
HEADER_BYTES = 256  # control block; the data area starts here (16-aligned)
ALIGN = 16

# Control block: byte offsets of uint64 fields. Slot index = offset // 8.
OFF_MAGIC = 0            # MAGIC
OFF_VERSION = 8          # LAYOUT_VERSION
OFF_HEADER_BYTES = 16    # HEADER_BYTES
OFF_CAPACITY = 24        # data bytes, a multiple of ALIGN
OFF_TOKEN = 32           # creator's (talker's) instance token
OFF_GENERATION = 40      # grows when a new consumer instance attaches
OFF_CREATED_NS = 48      # CLOCK_MONOTONIC ns at creation
OFF_CLOSED = 56          # 1 once the producer closed the ring
OFF_HEAD = 64            # producer cache line: bytes ever published
OFF_PRODUCER_HB = 72     # producer heartbeat, CLOCK_MONOTONIC ns
OFF_TAIL = 128           # consumer cache line: bytes ever released
OFF_CONSUMER_HB = 136    # consumer heartbeat, CLOCK_MONOTONIC ns (0 until attached)
OFF_WAITING = 144        # 0 when awake; else the epoch of the consumer's current wait
OFF_CONSUMER_TICK = 152  # the consumer's decode tick lately, ns (0: not reported): report_tick
OFF_CONSUMER_FIRST_AUDIO = 160  # the consumer's first audio lately, ns (0: none): report_tick
CONTROL_FORMAT = "<8Q"   # magic .. closed, for one-shot reads of the fixed fields

# Record header, little-endian, 32 bytes, then the payload: codes, int16 little-endian,
# row-major [num_frames, num_codebooks]. (field, struct code) in order; docs/protocol.md's
# record table is checked against this.
RECORD_FIELDS = (
    ("length", "I"),         # header + payload bytes (the record occupies align16(length))
    ("record_type", "H"),    # RecordType
    ("flags", "H"),          # RecordFlags
    ("finish_reason", "H"),  # FinishReason (set with LAST or SEGMENT_END)
    ("num_codebooks", "H"),
    ("num_frames", "I"),
    ("handle", "Q"),
    ("seq", "I"),            # per request, from 0
    ("first_frame", "I"),    # index of the record's first frame in its request
)
RECORD = struct.Struct("<" + "".join(code for _, code in RECORD_FIELDS))
RECORD_PREFIX = struct.Struct("<IH")  # length, record_type: all a WRAP marker carries
RECORD_HEADER_BYTES = RECORD.size
assert RECORD_HEADER_BYTES == 32

MAX_CAPACITY = 1 << 30
MIN_CAPACITY = 4096


class RecordType(enum.IntEnum):
    DATA = 1
    WRAP = 2


class RecordFlags(enum.IntFlag):
    LAST = 1
    CANCELLED = 2
    SEGMENT_END = 4  # a session's segment ended (finish reason: STOP, LENGTH, CANCELLED); the request goes on


KNOWN_FLAGS = int(RecordFlags.LAST | RecordFlags.CANCELLED | RecordFlags.SEGMENT_END)
# The flags as plain ints for FrameRecord's tests of them: an IntFlag's ``&`` builds an enum member
# (~1.5 us), read three times for every record a consumer takes
_LAST, _CANCELLED, _SEGMENT_END = (int(RecordFlags.LAST), int(RecordFlags.CANCELLED),
                                   int(RecordFlags.SEGMENT_END))


class FinishReason(enum.IntEnum):
    """Mirrors voxring.v1.FinishReason (common.proto); a test keeps them equal."""

    UNSPECIFIED = 0
    STOP = 1
    LENGTH = 2
    CANCELLED = 3
    DEADLINE = 4
    ERROR = 5
    STALLED = 6


MAX_FINISH_REASON = max(FinishReason)


# --- errors ------------------------------------------------------------------------


class RingError(Exception):
    """Base of every error a frame transport raises."""


class RingCorrupted(RingError):
    """A control block or record failed validation; nothing out of bounds was read."""


class RingFull(RingError):
    """``put`` timed out waiting for the consumer to free space (backpressure)."""


class RingClosed(RingError):
    """The producer closed the transport and every record was read."""


class PeerDead(RingError):
    """The other side's heartbeat is older than the liveness timeout."""


class RecordTooLarge(RingError, ValueError):
    """A record can never fit: it is larger than the transport's capacity."""

    def __init__(self, record_bytes: int, capacity: int) -> None:
        super().__init__(f"record of {record_bytes} bytes (header included, aligned) exceeds the "
                         f"ring capacity of {capacity} bytes")
        self.record_bytes = record_bytes
        self.capacity = capacity


# --- records -----------------------------------------------------------------------


class FrameRecord(NamedTuple):
    """The header values of one record (what every transport carries besides codes).

    Immutable; a NamedTuple rather than a frozen dataclass because the consumer builds
    one per record on the hot path and a frozen dataclass costs ~0.9 us to construct
    (a NamedTuple ~0.2 us).
    """

    handle: int
    seq: int
    first_frame: int
    num_frames: int
    num_codebooks: int
    flags: int = 0
    finish_reason: int = FinishReason.UNSPECIFIED

    @property
    def last(self) -> bool:
        return bool(self.flags & _LAST)

    @property
    def cancelled(self) -> bool:
        return bool(self.flags & _CANCELLED)

    @property
    def segment_end(self) -> bool:
        return bool(self.flags & _SEGMENT_END)


class RecordView(NamedTuple):
    """A received record. ``codes``: int16 [num_frames, num_codebooks]; for the ring it
    is a view into shared memory, valid only until the consumer's ``release()``."""

    record: FrameRecord
    codes: np.ndarray


def align16(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def record_bytes(payload_bytes: int) -> int:
    """Bytes a record with ``payload_bytes`` of codes occupies in a ring."""
    return align16(RECORD_HEADER_BYTES + payload_bytes)


_INT16 = np.dtype("<i2")


def as_codes(codes: np.ndarray | None) -> np.ndarray:
    """``codes`` as a C-contiguous little-endian int16 [num_frames, num_codebooks]
    array (None: no frames). Raises ValueError for other shapes or out-of-range values."""
    if codes is None:
        return np.zeros((0, 0), dtype=_INT16)
    if codes.ndim != 2:
        raise ValueError(f"codes must be [num_frames, num_codebooks], got shape {codes.shape}")
    num_frames, num_codebooks = codes.shape
    if num_codebooks > 0xFFFF or num_frames > 0xFFFFFFFF:
        raise ValueError(f"codes shape {codes.shape} exceeds the record header's fields")
    if codes.dtype == _INT16 and codes.flags.c_contiguous:
        return codes  # the common case, no copy
    if codes.dtype.kind not in "iu":
        raise ValueError(f"codes must be integers, got {codes.dtype}")
    if codes.size and (codes.min() < -32768 or codes.max() > 32767):
        raise ValueError("codes do not fit in int16")
    return np.ascontiguousarray(codes, dtype=_INT16)


def check_header_fields(handle: int, seq: int, first_frame: int, flags: int, finish_reason: int) -> None:
    """Raises ValueError when a header value does not fit its field (producer side)."""
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"handle must be a u64, got {handle}")
    if not 0 <= seq < 1 << 32 or not 0 <= first_frame < 1 << 32:
        raise ValueError(f"seq and first_frame must be u32, got {seq}, {first_frame}")
    if flags & ~KNOWN_FLAGS or flags < 0:
        raise ValueError(f"unknown flags {flags:#x} (known: LAST=1, CANCELLED=2, SEGMENT_END=4)")
    if not 0 <= finish_reason <= MAX_FINISH_REASON:
        raise ValueError(f"finish_reason {finish_reason} is not a FinishReason")


def check_record(length: int, flags: int, finish_reason: int, num_codebooks: int,
                 num_frames: int) -> None:
    """Raises RingCorrupted when a DATA record's header is inconsistent (consumer side)."""
    if num_frames * num_codebooks * 2 != length - RECORD_HEADER_BYTES:
        raise RingCorrupted(f"record payload of {length - RECORD_HEADER_BYTES} bytes does not hold "
                            f"{num_frames} frames x {num_codebooks} codebooks of int16")
    if flags & ~KNOWN_FLAGS:
        raise RingCorrupted(f"record has unknown flags {flags:#x}")
    if finish_reason > MAX_FINISH_REASON:
        raise RingCorrupted(f"record has unknown finish reason {finish_reason}")


# --- names -------------------------------------------------------------------------

# Every ring and wake-up semaphore name starts with "<prefix>-ring-" / "<prefix>-wake-".
# The prefix is "voxring" unless $VOXRING_SHM_PREFIX names another: stacks (or test runs)
# sharing one /dev/shm that must never see each other's entries, not even in a talker's
# start-up sweep, each set their own. Every process of one stack needs the same value
# (the talker names the rings; Code2Wav attaches to the names it is given).
SHM_PREFIX_ENV = "VOXRING_SHM_PREFIX"
DEFAULT_SHM_PREFIX = "voxring"
MAX_SHM_PREFIX = 32
# no "-": then "<p>-ring-" can never begin another prefix's names
_PREFIX = re.compile(r"[A-Za-z0-9_.]+")
SEM_FILE_PREFIX = "sem."  # glibc stores named semaphore NAME as /dev/shm/sem.NAME
_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")
MAX_CONSUMER_ID = 64


def shm_prefix() -> str:
    """This process's name prefix for rings and semaphores ($VOXRING_SHM_PREFIX, default
    "voxring"); raises ValueError naming the variable when its value is unusable."""
    value = os.environ.get(SHM_PREFIX_ENV, DEFAULT_SHM_PREFIX)
    if not _PREFIX.fullmatch(value) or len(value) > MAX_SHM_PREFIX:
        raise ValueError(f"{SHM_PREFIX_ENV} must be 1 to {MAX_SHM_PREFIX} characters of "
                         f"[A-Za-z0-9_.] (no '-'), got {value!r}")
    return value


def ring_prefix() -> str:
    """``<prefix>-ring-``: how this process's ring segment names begin."""
    return shm_prefix() + "-ring-"


def wake_prefix() -> str:
    """``<prefix>-wake-``: how this process's wake-up semaphore names begin."""
    return shm_prefix() + "-wake-"


def shm_file_prefixes() -> tuple[str, str]:
    """How this process's entries in /dev/shm begin: (ring segments, semaphore files)."""
    return ring_prefix(), SEM_FILE_PREFIX + wake_prefix()


def sanitize_consumer_id(consumer_id: str) -> str:
    """``consumer_id`` reduced to [A-Za-z0-9_.] (others become ``_``), at most 64 chars."""
    if not consumer_id:
        raise ValueError("consumer_id must not be empty")
    return _UNSAFE.sub("_", consumer_id)[:MAX_CONSUMER_ID]


def ring_names(talker_token: int, consumer_id: str, generation: int) -> tuple[str, str]:
    """(shared-memory name, semaphore name) of one ring, as posix_ipc spells them:
    ``/<prefix>-ring-<token hex16>-<consumer id>-g<generation>`` and ``/<prefix>-wake-...``
    (prefix: :func:`shm_prefix`)."""
    if not 0 <= talker_token < 1 << 64 or not 0 <= generation < 1 << 32:
        raise ValueError("talker_token must be a u64 and generation a u32")
    suffix = f"{talker_token:016x}-{sanitize_consumer_id(consumer_id)}-g{generation}"
    return f"/{ring_prefix()}{suffix}", f"/{wake_prefix()}{suffix}"


def wake_name_for(ring_name: str) -> str:
    """The semaphore name that goes with shared-memory name ``ring_name`` (any prefix)."""
    prefix, sep, suffix = ring_name.lstrip("/").partition("-ring-")
    if not sep or not _PREFIX.fullmatch(prefix):
        raise ValueError(f"not a voxring ring name: {ring_name!r}")
    return f"/{prefix}-wake-{suffix}"


# --- architecture and fences -------------------------------------------------------

_X86_64 = ("x86_64", "AMD64", "amd64")


def require_x86_64() -> None:
    """The ordering argument above holds on x86-64 only; refuse anything else."""
    machine = platform.machine()
    if machine not in _X86_64:
        raise RuntimeError(
            f"voxring's shared-memory ring relies on x86-64 memory ordering (TSO); this machine is "
            f"{machine or 'unknown'}. Use transport kind 'grpc' here.")


_FENCE_LOCK = threading.Lock()


def full_fence() -> None:
    """A full memory barrier. Acquiring a lock needs an atomic read-modify-write (any
    correct mutex does), and every atomic RMW on x86-64 is ``lock``-prefixed, which
    orders all earlier loads and stores before all later ones. Costs ~70 ns."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()
