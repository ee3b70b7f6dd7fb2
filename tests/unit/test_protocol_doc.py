"""docs/protocol.md against what it describes: every RPC, message and enum of protos/ has its
own section (and no section names one that is gone), each message section names every field,
each enum section every value, each RPC section its request and response types and its
statuses; the ring's record, flag and control-block tables equal services/transport/layout.py.
The checks return their findings, so a test feeds them a broken page too: they can fail."""

from __future__ import annotations

import re
import struct

import grpc
import pytest

from services.transport import layout
from tests.conftest import REPO
from voxring.v1 import code2wav_pb2, common_pb2, frames_pb2, synthesizer_pb2, talker_pb2

DOC = REPO / "docs" / "protocol.md"
FILES = [m.DESCRIPTOR for m in (common_pb2, talker_pb2, code2wav_pb2, frames_pb2, synthesizer_pb2)]
STATUS_NAMES = {code.name for code in grpc.StatusCode}
HEADING = re.compile(r"^### (rpc|message|enum) (\S+)\s*$", re.M)
TYPES = {"H": "u16", "I": "u32", "Q": "u64"}


def sections(text: str) -> dict[tuple[str, str], str]:
    """(kind, name) -> the section's text, up to the next heading of any level."""
    found = {}
    for match in HEADING.finditer(text):
        rest = text[match.end():]
        end = re.search(r"^#{1,6} ", rest, re.M)
        found[(match.group(1), match.group(2))] = rest[:end.start()] if end else rest
    return found


def _messages(descriptor, prefix=""):
    for message in descriptor.message_types_by_name.values() if prefix == "" else descriptor.nested_types:
        name = prefix + message.name
        yield name, message
        yield from _messages(message, name + ".")


def _enums(file):
    yield from ((e.name, e) for e in file.enum_types_by_name.values())
    for name, message in _messages(file):
        yield from ((f"{name}.{e.name}", e) for e in message.enum_types)


def expected() -> dict[tuple[str, str], object]:
    """What protos/ defines: (kind, name) -> its descriptor."""
    items = {}
    for file in FILES:
        for service in file.services_by_name.values():
            items.update({("rpc", f"{service.name}.{m.name}"): m for m in service.methods})
        items.update({("message", name): m for name, m in _messages(file)})
        items.update({("enum", name): e for name, e in _enums(file)})
    return items


def _named(section: str, name: str) -> bool:
    return f"`{name}`" in section


def coverage_problems(text: str) -> list[str]:
    found, wanted = sections(text), expected()
    problems = [f"no section '### {kind} {name}'" for kind, name in wanted if (kind, name) not in found]
    problems += [f"'### {kind} {name}' names nothing in protos/" for kind, name in found
                 if (kind, name) not in wanted]
    for key, descriptor in wanted.items():
        section = found.get(key)
        if section is None:
            continue
        kind, name = key
        if kind == "message":
            missing = [f.name for f in descriptor.fields if not _named(section, f.name)]
            if not descriptor.fields and "No fields" not in section:
                missing = ["(say 'No fields')"]
        elif kind == "enum":
            missing = [v.name for v in descriptor.values if not _named(section, v.name)]
        else:
            missing = [t.name for t in (descriptor.input_type, descriptor.output_type)
                       if not _named(section, t.name)]
            statuses = re.search(r"Statuses:(.*?)(?:\n\n|$)", section, re.S)
            codes = set(re.findall(r"\b[A-Z][A-Z_]*[A-Z]\b", statuses.group(1))) & STATUS_NAMES \
                if statuses else set()
            if "OK" not in codes or not codes & (STATUS_NAMES - {"OK"}):
                missing.append("a 'Statuses:' paragraph naming OK and the error codes")
        problems += [f"{kind} {name}: does not name {item}" for item in missing]
    return problems


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header line is ``header``."""
    start = text.index(header)
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    return rows


def ring_problems(text: str) -> list[str]:
    problems = []
    offset, want = 0, []
    for name, code in layout.RECORD_FIELDS:
        want.append([str(offset), TYPES[code], name])
        offset += struct.calcsize("<" + code)
    got = [row[:3] for row in _table(text, "| offset | type | field | meaning |")]
    if got[:-1] != want or got[-1][0] != str(layout.RECORD_HEADER_BYTES) or got[-1][2] != "payload":
        problems.append(f"record table {got} differs from layout.RECORD_FIELDS {want} + payload")
    flags = {row[0]: row[1] for row in _table(text, "| flag | value | meaning |")}
    if flags != {f.name: str(int(f)) for f in layout.RecordFlags}:
        problems.append(f"flag table {flags} differs from layout.RecordFlags")
    control = {row[1]: int(row[0]) for row in _table(text, "| offset | field | written by | meaning |")}
    offsets = {name.removeprefix("OFF_"): value for name, value in vars(layout).items()
               if name.startswith("OFF_")}
    if control != offsets:
        problems.append(f"control-block table {control} differs from layout's OFF_* {offsets}")
    version = re.search(r"ring layout version (\d+)", text)
    if version is None or int(version.group(1)) != layout.LAYOUT_VERSION:
        problems.append(f"the ring layout version is not layout.LAYOUT_VERSION ({layout.LAYOUT_VERSION})")
    return problems


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def test_every_rpc_message_and_enum_has_its_section(doc):
    problems = coverage_problems(doc)
    assert not problems, "\n".join(problems)


def test_ring_tables_equal_the_layout(doc):
    problems = ring_problems(doc)
    assert not problems, "\n".join(problems)


def test_the_checks_find_a_broken_page(doc):
    no_field = doc.replace("| `first_audio_budget_s` | what is left", "| `budget` | what is left", 1)
    assert any("SubmitRequest: does not name first_audio_budget_s" in p for p in coverage_problems(no_field))
    no_rpc = doc.replace("### rpc Talker.Clear", "### Talker.Clear", 1)
    assert "no section '### rpc Talker.Clear'" in coverage_problems(no_rpc)
    stale = doc + "\n### message Gone\n\nNo fields.\n"
    assert "'### message Gone' names nothing in protos/" in coverage_problems(stale)
    no_status = re.sub(r"(### rpc Talker.Stats\n\n[^\n]*\n)Statuses:", r"\1Answers:", doc)
    assert any(p.startswith("rpc Talker.Stats") for p in coverage_problems(no_status))
    moved = doc.replace("| 24 | u32 | `seq` |", "| 24 | u16 | `seq` |", 1)
    assert any(p.startswith("record table") for p in ring_problems(moved))
    flag = doc.replace("| `SEGMENT_END` | 4 |", "| `SEGMENT_END` | 8 |", 1)
    assert any(p.startswith("flag table") for p in ring_problems(flag))
