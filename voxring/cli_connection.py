"""How the CLI's client commands reach a gateway: --target, --token-file (or
$VOXRING_TOKEN_FILE) and the TLS options, turned into the SDK client's arguments.

grpc-free at import, as voxring.cli must be.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_TARGET = "127.0.0.1:50051"
TOKEN_FILE_ENV = "VOXRING_TOKEN_FILE"  # the default of --token-file


class UsageError(Exception):
    """A bad option value (an unreadable file); the command exits 2 with the message."""


def tls_options(args: argparse.Namespace) -> dict:
    """The TLS arguments of a client from --tls, --tls-ca and --tls-server-name."""
    roots = None
    if args.tls_ca is not None:
        try:
            roots = args.tls_ca.read_bytes()
        except OSError as exc:
            raise UsageError(f"--tls-ca {args.tls_ca}: cannot read: {exc.strerror or exc}") from None
        if b"-----BEGIN CERTIFICATE-----" not in roots:
            raise UsageError(f"--tls-ca {args.tls_ca}: holds no PEM certificate")
    tls = bool(args.tls or roots is not None)
    if args.tls_server_name is not None and not tls:
        raise UsageError("--tls-server-name: needs --tls or --tls-ca")
    return {"tls": tls, "root_certificates": roots, "tls_server_name": args.tls_server_name}


def read_token(args: argparse.Namespace) -> str | None:
    """The bearer token from --token-file, else from the file $VOXRING_TOKEN_FILE names.
    Messages name the option or the variable, never the token."""
    path, source = args.token_file, "--token-file"
    if path is None and os.environ.get(TOKEN_FILE_ENV):
        path, source = Path(os.environ[TOKEN_FILE_ENV]), f"${TOKEN_FILE_ENV}"
    if path is None:
        return None
    try:
        token = path.read_bytes().decode("ascii").strip()
    except OSError as exc:
        raise UsageError(f"{source} {path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{source} {path}: the token must be printable ASCII") from None
    if not token:
        raise UsageError(f"{source} {path}: the file is empty; it must hold the bearer token")
    if not all("!" <= ch <= "~" for ch in token):
        raise UsageError(f"{source} {path}: the token must be one word of printable ASCII")
    return token


def client_arguments(args: argparse.Namespace) -> dict:
    """The Client keyword arguments for the gateway: token and TLS."""
    return {"token": read_token(args), **tls_options(args)}


def add_tls_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """``suppress``: no defaults (a sub-command's copy leaves what its parent parsed)."""
    unset = argparse.SUPPRESS if suppress else None
    parser.add_argument("--tls", action="store_true", default=argparse.SUPPRESS if suppress else False,
                        help="connect with TLS, trusting the system's root certificates")
    parser.add_argument("--tls-ca", type=Path, default=unset, metavar="PEM",
                        help="connect with TLS, trusting the CA certificates in this PEM file")
    parser.add_argument("--tls-server-name", default=unset, metavar="NAME",
                        help="the name the server's certificate must carry, when it is not "
                             "the address's host")


def add_connection_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """--target, --token-file and TLS, for the commands that talk to a gateway."""
    parser.add_argument("--target", default=argparse.SUPPRESS if suppress else DEFAULT_TARGET,
                        help=f"the gateway, HOST:PORT or unix:PATH (default {DEFAULT_TARGET})")
    parser.add_argument("--token-file", type=Path, default=argparse.SUPPRESS if suppress else None,
                        metavar="PATH", help=f"a file holding the gateway's bearer token (default: "
                                             f"the file ${TOKEN_FILE_ENV} names, if set)")
    add_tls_options(parser, suppress)
