"""``voxring voices``: list the server's voices, ``voices add NAME CLIP --transcript TEXT``
adds one from a reference clip (any common audio format), ``voices rm NAME`` removes one
added so.

grpc-free at import, as voxring.cli must be: the client is loaded when a command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from voxring.errors import VoxringError

DESCRIPTION = ("List the server's voices (* marks the default, + a voice added through the API), "
               "add one from a reference clip and its transcript (voices add NAME CLIP "
               "--transcript TEXT; WAV, FLAC, MP3, Ogg, M4A...), or remove an added one "
               "(voices rm NAME).")
TIMEOUTS = {None: 10.0, "add": 60.0, "rm": 10.0}  # default deadlines: adding encodes the clip


def add_voices_arguments(voices: argparse.ArgumentParser, positive: Callable,
                         connection_options: Callable[[argparse.ArgumentParser], None]) -> None:
    """The options of ``voices`` and its ``add`` and ``rm`` commands; ``connection_options``
    adds --target, --token-file and TLS to a parser (each takes them, before or after the
    command's own arguments)."""
    actions = voices.add_subparsers(dest="voices_command", metavar="{add,rm}")
    add = actions.add_parser("add", help="add a voice from a reference clip",
                             description="Add voice NAME from the reference clip CLIP (an audio file "
                                         "in any common format) and its transcript; usable at once "
                                         "(voxring say --voice NAME).")
    add.add_argument("name", metavar="NAME", help="letters, digits, '.', '_', '-' (up to 64)")
    add.add_argument("clip", metavar="CLIP", type=Path, help="the reference clip's file")
    add.add_argument("--transcript", required=True, help="what the clip says")
    add.add_argument("--speaker", type=int, default=0, metavar="N",
                     help="the model's speaker id the clip's turn is spoken as (default 0)")
    add.add_argument("--language", default=None, help="language code (default: the server's)")
    add.add_argument("--description", default=None, help="shown by voxring voices")
    rm = actions.add_parser("rm", help="remove a voice added through the API",
                            description="Remove voice NAME, which was added through the API.")
    rm.add_argument("name", metavar="NAME")
    for parser in (voices, add, rm):
        # on the commands: no default, so that the one given before the command stands
        default = None if parser is voices else argparse.SUPPRESS
        parser.add_argument("--timeout", type=positive(float), default=default,
                            help="deadline, seconds (default: 10; add: 60)")
        connection_options(parser, default is argparse.SUPPRESS)


def run_voices_command(args: argparse.Namespace, connection: dict) -> int:
    from voxring.client import Client

    command = args.voices_command
    name = f"voxring voices{' ' + command if command else ''}"
    timeout = args.timeout if args.timeout is not None else TIMEOUTS[command]
    try:
        with Client(args.target, timeout=timeout, **connection) as client:
            if command == "add":
                voice = client.create_voice(args.name, args.clip, args.transcript, speaker_id=args.speaker,
                                            language_code=args.language, description=args.description)
                print(f"added voice {voice.name} (speaker {voice.speaker_id}, {voice.language_code}); "
                      f"use it with `voxring say --voice {voice.name}`")
            elif command == "rm":
                client.delete_voice(args.name)
                print(f"removed voice {args.name}")
            else:
                print_voices(client.voices())
    except VoxringError as exc:
        print(f"{name}: {exc.describe()}", file=sys.stderr)
        return 1
    return 0


def print_voices(voices) -> None:
    """A table of the voices; * marks the default, + one added through the API; then the
    aliases (other names of a voice, e.g. OpenAI's "alloy")."""
    rows = [("", "NAME", "SPEAKER", "LANGUAGE", "REFERENCE", "DESCRIPTION")]
    rows += [("*" if v.is_default else "+" if v.removable else "", v.name, str(v.speaker_id),
              v.language_code, "yes" if v.has_reference else "no", v.description) for v in voices]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    aliased = [f"{', '.join(v.aliases)} -> {v.name}" for v in voices if v.aliases]
    if aliased:
        print("aliases: " + "; ".join(aliased))
    added = "; + added through the API (`voxring voices rm NAME` removes it)" \
        if any(v.removable for v in voices) else ""
    print(f"(* default voice: {voices.default_voice or 'none'}{added})")
