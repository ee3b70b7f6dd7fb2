"""Config sections every stage shares: where it listens and how it logs."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from services.common.config import ConfigValueError
from services.common.log import LEVELS


def parse_listen(address: str) -> tuple[str, int | None]:
    """Splits a listen address into (host, port) or ("unix:PATH", None).

    Accepted: ``HOST:PORT`` (port 0 picks a free one), ``[IPV6]:PORT`` and ``unix:PATH``
    (a socket file; ``unix:///abs`` too). Raises ValueError with the reason.
    """
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError("unix: needs a socket path")
        return address, None
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT or unix:PATH, got {address!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"port must be 0..65535, got {port_text!r}")
    if host.startswith("[") and host.endswith("]"):
        ipaddress.IPv6Address(host[1:-1])
    return host, int(port_text)


def is_loopback(address: str) -> bool:
    """True for unix sockets and loopback hosts (127.0.0.0/8, ::1, localhost)."""
    host, port = parse_listen(address)
    if port is None:
        return True
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSection:
    """Where a stage listens and how it stops.

    On SIGTERM/SIGINT the stage reports NOT_SERVING, refuses new calls with
    UNAVAILABLE, lets in-flight calls finish for up to ``drain_timeout`` seconds, ends
    the rest UNAVAILABLE, then stops the server with ``grace`` seconds for the last
    messages to leave.
    """

    listen: str = "127.0.0.1:50051"
    drain_timeout: float = 30.0
    grace: float = 5.0
    max_message_mb: int = 64

    def __post_init__(self) -> None:
        try:
            parse_listen(self.listen)
        except ValueError as exc:
            raise ConfigValueError("listen", str(exc)) from None
        if not self.drain_timeout >= 0:
            raise ConfigValueError("drain_timeout", f"must be >= 0 seconds, got {self.drain_timeout}")
        if not self.grace >= 0:
            raise ConfigValueError("grace", f"must be >= 0 seconds, got {self.grace}")
        if self.max_message_mb < 1:
            raise ConfigValueError("max_message_mb", f"must be >= 1, got {self.max_message_mb}")


@dataclass(frozen=True)
class LoggingSection:
    level: str = "info"
    json: bool = False

    def __post_init__(self) -> None:
        if self.level.lower() not in LEVELS:
            raise ConfigValueError("level", f"must be one of {', '.join(LEVELS)}, got {self.level!r}")


@dataclass(frozen=True)
class ModelSection:
    checkpoint: str | None = None   # a CSM checkpoint folder; null: voxring-tiny, made on first use
    dtype: str = "float32"          # float32, bfloat16, float16
    device: str = "auto"            # auto (cuda when present), cpu, cuda, cuda:N
    tiny_seed: int = 0              # which voxring-tiny, when checkpoint is null

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigValueError("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigValueError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class ChunkSection:
    """The chunk schedule used when a request carries none (the gateway normally sends
    one): chunk n holds min(steady_frames, ceil(first_frames * growth**n)) frames."""

    first_frames: int = 2
    growth: float = 2.0
    steady_frames: int = 16

    def __post_init__(self) -> None:
        if self.first_frames < 1:
            raise ConfigValueError("first_frames", f"must be >= 1, got {self.first_frames}")
        if not self.growth >= 1.0:
            raise ConfigValueError("growth", f"must be >= 1, got {self.growth}")
        if self.steady_frames < self.first_frames:
            raise ConfigValueError("steady_frames", "must be >= first_frames")
