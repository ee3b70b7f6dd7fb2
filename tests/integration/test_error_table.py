"""docs/errors.md against the running servers, so that the page cannot drift: its codes table
holds exactly the words of services/common/error_codes.py, with the statuses the servers map
them to; every row of its HTTP, gRPC and WebSocket tables is sent to a real gateway (its
check in error_table_cases.py) and the answer must be that row's status, code, param (field)
and message, and no answer may show an internal address. A row without a check, or a check
without a row, fails too. The parsers return what they found, so a test feeds them a broken
page as well."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest

from models.tiny.talker import ensure_tiny_checkpoint
from services.common import error_codes
from services.common.rich_status import FIELD_METADATA, RETRY_AFTER_METADATA
from services.gateway.http.errors import STATUS_OF_CODE, error_type
from services.gateway.http.speech_stream import close_code
from tests.conftest import REPO, StageGroup
from tests.integration import error_table_cases as cases
from tests.integration.http_helpers import pair_configs, start_stages
from tests.integration.test_http_api import _gateway_config

DOC = REPO / "docs" / "errors.md"
TABLES = {"HTTP": cases.HTTP_CASES, "gRPC": cases.GRPC_CASES, "WebSocket": cases.WS_CASES}
# where an internal address would show: an IP, a unix socket, a port
ADDRESS = re.compile(r"\b\d{1,3}(\.\d{1,3}){3}\b|unix:|\.sock\b|\[[0-9a-f:]+\]|[a-z0-9]:\d{2,5}\b", re.I)
NONE = "—"


def table_after(text: str, heading: str) -> list[dict[str, str]]:
    """The rows of the first table under ``heading`` (a line of its own), as {column: cell},
    a cell that is one code span without its backticks (but the input's, the checks' key);
    [] when there is none."""
    match = re.search(rf"^{re.escape(heading)}\s*$", text, re.M)
    if match is None:
        return []
    lines = text[match.end():].lstrip("\n").splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            if rows or line.startswith("#"):
                break
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    if len(rows) < 2:
        return []
    header = rows[0]
    return [{name: cell if name == "input" else _bare(cell) for name, cell in zip(header, row, strict=True)}
            for row in rows[2:]]


def _bare(cell: str) -> str:
    """A cell that is one code span, without its backticks (an input keeps them)."""
    return cell[1:-1] if cell.count("`") == 2 and cell.startswith("`") and cell.endswith("`") else cell


def pattern(message: str) -> re.Pattern:
    """A message cell as a regular expression: ``…`` stands for any text."""
    return re.compile(".*".join(map(re.escape, message.split("…"))), re.S)


def doc_tables(text: str) -> dict[str, list[dict[str, str]]]:
    return {api: table_after(text, f"### {api}") for api in TABLES}


def code_table(text: str) -> dict[str, dict[str, str]]:
    return {row["code"]: row for row in table_after(text, "## The codes")}


def unchecked(rows: list[dict[str, str]], checks: dict) -> tuple[set[str], set[str]]:
    """(inputs of rows without a check, checks without a row)."""
    inputs = {row["input"] for row in rows}
    return inputs - set(checks), set(checks) - inputs


TEXT = DOC.read_text()
ROWS = [(api, row) for api, rows in doc_tables(TEXT).items() for row in rows]


def test_the_parsers_read_the_page_and_see_a_broken_one():
    assert {api: len(rows) for api, rows in doc_tables(TEXT).items()} == {
        api: len(checks) for api, checks in TABLES.items()}
    broken = TEXT.replace("| no `input` |", "| no `model` |")
    missing, extra = unchecked(doc_tables(broken)["HTTP"], cases.HTTP_CASES)
    assert (missing, extra) == ({"no `model`"}, {"no `input`"})
    assert table_after("### HTTP\n\nno table here\n", "### HTTP") == []
    assert pattern("speed: …").fullmatch("speed: must be in [0.25, 4]")
    assert not pattern("`a` b").fullmatch("a b")


@pytest.mark.parametrize("api", list(TABLES))
def test_every_row_has_a_check_and_every_check_a_row(api):
    assert unchecked(doc_tables(TEXT)[api], TABLES[api]) == (set(), set())


def test_the_codes_table_is_the_vocabulary_with_its_statuses():
    table = code_table(TEXT)
    assert set(table) == error_codes.ALL
    for code, row in table.items():
        grpc_status = row["gRPC"]
        if grpc_status != NONE:
            assert error_codes.OF_STATUS[grpc_status] == code or code in (
                error_codes.VOICE_NOT_FOUND,), (code, grpc_status)
            assert STATUS_OF_CODE[grpc_status] == int(row["HTTP"]), code
        if row["WebSocket"].isdigit() and row["HTTP"].isdigit() and row["WebSocket"] != "1009":
            assert close_code(int(row["HTTP"])) == int(row["WebSocket"]), code
    for api, row in ROWS:  # each row's status is its code's
        code = row.get("code") or row.get("ErrorInfo.reason")
        status = row.get("status") or row.get("close")
        assert table[code][api] == status, (api, row["input"], code, status)


@pytest.fixture(scope="module")
def stack(model_cache):
    ensure_tiny_checkpoint(root=model_cache / "models")
    d = Path(tempfile.mkdtemp(prefix="vx-err-", dir="/tmp"))  # short: unix socket paths
    (d / "token").write_text(cases.TOKEN + "\n")
    http = "http: {listen: '127.0.0.1:0', max_body_mb: 1}\n"
    pair = pair_configs(d)
    pair["talker"] += "metrics: {listen: '127.0.0.1:0'}\n"  # error_table_cases.held reads its rows
    configs = {
        **pair,
        "gateway": _gateway_config(d, "gateway", "") + http + "auth: {token_file: token}\n"
        "admission: {max_in_flight: 1}\nvoices: {store: voices}\n",
        "gateway-noc2w": _gateway_config(d, "gateway-noc2w", "", code2wav="no-code2wav") + http,
        "gateway-dead": _gateway_config(d, "gateway-dead", "", "no-talker", "no-code2wav") + http,
    }
    stages = StageGroup(d)
    try:
        info = start_stages(stages, configs)
        yield {"talker": info["talker"],
               **{name: {**info[f"gateway{suffix}"], "grpc": f"unix:{d}/gateway{suffix}.sock"}
                  for name, suffix in (("main", ""), ("noc2w", "-noc2w"), ("dead", "-dead"))}}
    finally:
        codes = stages.close()
        shutil.rmtree(d, ignore_errors=True)
    assert codes == dict.fromkeys(stages.stages, 0), f"not every stage exited 0: {codes}"


@pytest.mark.parametrize(("api", "row"), ROWS, ids=[f"{api}: {row['input']}"[:70] for api, row in ROWS])
def test_each_row_is_what_the_server_answers(stack, api, row):
    seen = TABLES[api][row["input"]](stack)
    status = row.get("status") or row.get("close")
    code = row.get("code") or row.get("ErrorInfo.reason")
    param = row.get("param") or row.get("field")
    assert (seen.status, seen.code, seen.param) == (status, code, None if param == NONE else param), seen
    assert pattern(row["message"]).fullmatch(seen.message), (row["message"], seen.message)
    assert not ADDRESS.search(seen.wire.replace(cases.TOKEN, "")), seen.wire
    if api == "HTTP":
        assert seen.extra["type"] == error_type(int(seen.status))
        assert (seen.extra["retry-after"] is not None) == (code == error_codes.RATE_LIMIT_EXCEEDED)
    elif api == "gRPC":
        assert seen.extra["domain"] == error_codes.DOMAIN
        assert seen.extra.get(FIELD_METADATA) == seen.param  # the plain trailer agrees
        assert (RETRY_AFTER_METADATA in seen.extra) == (code == error_codes.RATE_LIMIT_EXCEEDED)
    elif seen.status.isdigit():
        assert seen.extra["reason"] == code  # the close's reason
        assert (seen.extra["retry_after"] is not None) == (code == error_codes.RATE_LIMIT_EXCEEDED)
