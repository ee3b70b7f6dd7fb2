"""Config sections every stage shares: where it listens and how it logs."""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from services.common.config import ConfigError, ConfigValueError
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

    ``tls_cert`` and ``tls_key`` (both or neither): PEM files, absolute or relative to
    the process's working directory, of the server's certificate chain and its
    unencrypted private key. Set, the stage serves TLS only; they are read and checked
    at start-up (:func:`read_tls_files`).
    """

    listen: str = "127.0.0.1:50051"
    drain_timeout: float = 30.0
    grace: float = 5.0
    max_message_mb: int = 64
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        try:
            parse_listen(self.listen)
        except ValueError as exc:
            raise ConfigValueError("listen", str(exc)) from None
        for key in ("tls_cert", "tls_key"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise ConfigValueError(key, "must be a PEM file path, got an empty string "
                                            "(null turns TLS off)")
        if (self.tls_cert is None) != (self.tls_key is None):
            missing, given = ("tls_key", "tls_cert") if self.tls_key is None else ("tls_cert", "tls_key")
            raise ConfigValueError(missing, f"missing: {given} is set, and TLS needs both tls_cert "
                                            f"(certificate chain PEM) and tls_key (private key PEM)")
        if not self.drain_timeout >= 0:
            raise ConfigValueError("drain_timeout", f"must be >= 0 seconds, got {self.drain_timeout}")
        if not self.grace >= 0:
            raise ConfigValueError("grace", f"must be >= 0 seconds, got {self.grace}")
        if self.max_message_mb < 1:
            raise ConfigValueError("max_message_mb", f"must be >= 1, got {self.max_message_mb}")


@dataclass(frozen=True)
class InternalServerSection(ServerSection):
    """The server section of an internal stage (talker, Code2Wav). Their peers (the
    gateway, Code2Wav attaching to a talker) connect in plaintext, so TLS here would only
    break the stack: it is refused at start-up. Keep these on loopback or a unix socket."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("tls_cert", "tls_key"):
            if getattr(self, key) is not None:
                raise ConfigValueError(key, "TLS is served by the gateway only: this internal "
                                            "stage's peers connect in plaintext (keep it on "
                                            "loopback or a unix socket); set it to null")


def _read_pem(section: str, key: str, path_text: str, marker: str, what: str) -> bytes:
    path = Path(path_text)
    where = f"{section}.{key}"
    shown = f"{path_text!r}" + ("" if path.is_absolute() else f" (resolved: {path.absolute()})")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {shown}: {exc.strerror or exc}") from None
    if marker.encode() not in data:
        raise ConfigError(f"{where}: {shown} holds no PEM {what} ('-----BEGIN {marker}' not found)")
    return data


def read_tls_files(server: ServerSection, section: str = "server") -> tuple[bytes, bytes] | None:
    """The ``(private key, certificate chain)`` PEM bytes of ``server.tls_key`` and
    ``server.tls_cert``, or None when TLS is off.

    Checked here, at start-up, rather than at the first handshake: both files readable,
    PEM of the right kind, the key unencrypted and matching the certificate. Any problem
    is a :class:`ConfigError` naming the key (``server.tls_cert`` / ``server.tls_key``).
    """
    if server.tls_cert is None or server.tls_key is None:
        return None
    cert = _read_pem(section, "tls_cert", server.tls_cert, "CERTIFICATE", "certificate")
    key = _read_pem(section, "tls_key", server.tls_key, "PRIVATE KEY", "private key")
    if b"ENCRYPTED" in key.split(b"-----END", 1)[0]:
        raise ConfigError(f"{section}.tls_key: {server.tls_key!r} is an encrypted private key; "
                          f"gRPC needs it unencrypted (protect the file instead)")
    asked_for_password = []

    def no_password() -> bytes:  # never prompt on a terminal
        asked_for_password.append(True)
        return b""

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # the certificates alone first, so that a bad key is not blamed on them
        context.load_verify_locations(cadata=cert.decode("ascii", "replace"))
    except ssl.SSLError as exc:
        raise ConfigError(f"{section}.tls_cert: {server.tls_cert!r} is not a valid PEM "
                          f"certificate chain ({exc.reason or exc})") from None
    try:
        context.load_cert_chain(server.tls_cert, server.tls_key, password=no_password)
    except ssl.SSLError as exc:
        if asked_for_password:
            raise ConfigError(f"{section}.tls_key: {server.tls_key!r} is an encrypted private key; "
                              f"gRPC needs it unencrypted (protect the file instead)") from None
        if "KEY_VALUES_MISMATCH" in (exc.reason or "") or "key values mismatch" in str(exc):
            raise ConfigError(f"{section}.tls_key: {server.tls_key!r} is not the private key of "
                              f"the certificate in {section}.tls_cert ({server.tls_cert!r})") from None
        raise ConfigError(f"{section}.tls_key: {server.tls_key!r} is not a usable PEM private key "
                          f"for {section}.tls_cert ({exc.reason or exc})") from None
    except OSError as exc:  # a file went away between the two reads
        raise ConfigError(f"{section}.tls_key: cannot read {server.tls_key!r} or "
                          f"{section}.tls_cert {server.tls_cert!r}: {exc.strerror or exc}") from None
    return key, cert


@dataclass(frozen=True)
class LoggingSection:
    level: str = "info"
    json: bool = False

    def __post_init__(self) -> None:
        if self.level.lower() not in LEVELS:
            raise ConfigValueError("level", f"must be one of {', '.join(LEVELS)}, got {self.level!r}")


# ``model.checkpoint: tiny:NAME``: a family's tiny default (models/tiny/talker.py TINY_CHECKPOINTS)
TINY_CHECKPOINTS = ("csm", "qwen-omni")


@dataclass(frozen=True)
class ModelSection:
    # a checkpoint folder (its config.json names the family); tiny:csm or tiny:qwen-omni, a family's
    # tiny default; null: voxring-tiny (tiny:csm); a tiny default is made on first use
    checkpoint: str | None = None
    dtype: str = "float32"          # float32, bfloat16, float16
    device: str = "auto"            # auto (cuda when present), cpu, cuda, cuda:N
    tiny_seed: int = 0              # which tiny default, when checkpoint is null or tiny:NAME
    threads: int = 0                # torch's CPU threads in this stage; 0: torch's default (OMP_NUM_THREADS)
    require_mps: bool = False       # on a GPU: readiness stays NOT_SERVING unless an MPS client

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ConfigValueError("threads", f"must be >= 0 (0: torch's default), got {self.threads}")
        if self.checkpoint and self.checkpoint.startswith("tiny:") \
                and self.checkpoint[len("tiny:"):] not in TINY_CHECKPOINTS:
            raise ConfigValueError("checkpoint", f"{self.checkpoint!r} is no tiny default (one of "
                                   f"{', '.join('tiny:' + name for name in TINY_CHECKPOINTS)})")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigValueError("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigValueError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
