"""`voxring --help` and every subcommand's help render as plain text: argparse prints help
strings and descriptions as they are, so reStructuredText markup (double backticks, roles
such as :func:`x`) from a docstring would reach the terminal raw."""

from __future__ import annotations

import argparse
import re

import pytest

from voxring import cli

RST = re.compile(r"``|:[a-z]+:`")  # a literal, or a role (:func:`x`, :class:`x`, ...)
EXPECTED = {(), ("up",), ("down",), ("status",), ("demo",), ("say",), ("voices",), ("voices", "add"),
            ("voices", "rm"), ("bench",), ("health",)}


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _root_parser(monkeypatch) -> argparse.ArgumentParser:
    """The parser cli.main builds (stopped where it would parse the arguments)."""
    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed) as caught:
        cli.main([])
    monkeypatch.undo()
    return caught.value.parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of the parser and every subcommand under it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def test_every_command_is_found(monkeypatch):
    assert {path for path, _ in _commands(_root_parser(monkeypatch))} >= EXPECTED


def test_help_has_no_restructuredtext(monkeypatch, capsys):
    paths = [path for path, _ in _commands(_root_parser(monkeypatch))]
    for path in paths:
        with pytest.raises(SystemExit) as exited:
            cli.main([*path, "--help"])  # what `voxring ... --help` prints
        assert exited.value.code == 0
        shown = capsys.readouterr().out
        assert shown.startswith("usage: voxring"), (path, shown[:200])
        markup = sorted({m.group(0) for m in RST.finditer(shown)})
        assert not markup, f"`{' '.join(('voxring', *path))} --help` shows markup {markup}:\n{shown}"
