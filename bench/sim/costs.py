"""The device cost model: how long GPU work takes, read from a cost file (h200.json, written by
build_costs.py from committed result files). The loader validates the whole file and serves
lookups; it estimates nothing beyond piecewise-linear interpolation between the file's points.
No torch here: json, math, hashlib, dataclasses and pathlib only."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATH = Path(__file__).with_name("h200.json")
PROFILES = ("ee9c553", "3d75c85", "db1c4a9", "tip")
SLOTS = ("talker_step", "prefill", "prefill_graphed", "codec", "copy", "sharing")
REPLAY_LAUNCH_MS = 0.05  # a graph replay's host launch (rule "replay_launch" in the file)
EAGER_OP_MS = 0.01       # an eager op's host dispatch (rule "step_launch")
STEP_OPS, STEP_OPS_PER_FRAME = 40, 1  # eager ops of a talker decode step beside its replays
# GIL releases of one call (rule "gil_ops"): eager ops, each giving the GIL up around its launch
PREFILL_OPS, PREFILL_OPS_PER_ROW = 300, 10
CODEC_GRAPH_OPS, CODEC_EAGER_OPS = 8, 300
# A graphed, asynchronous prefill call's host work (rule "graphed_prefill_launch", estimated): the
# staged copy of the packed prompt chunks into pinned memory and its one H2D copy, the scatters of
# the rows' pool state, an event: eager ops at EAGER_OP_MS each, and one graph replay.
GRAPHED_PREFILL_OPS = 12
TOP_KEYS = {"format", "gpu", "rules", "profiles", "tables"}


class CostFileError(ValueError):
    """A cost file that does not validate, or a lookup outside what it holds; the message names
    the file and the key path."""


def _pwl(points, x):
    """Piecewise-linear in x over sorted (x, y) points (two or more): exact at a point, clamped
    below the first, extrapolated from the last two past the last."""
    if x <= points[0][0]:
        return points[0][1]
    for i in range(1, len(points)):  # no itertools: the loader keeps to five stdlib modules
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        if x == x1:
            return y1
        if x < x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


class _Reader:
    """Validation helpers; every failure names the file and the key path."""

    def __init__(self, name: str, rules: dict):
        self.name, self.rules = name, rules

    def fail(self, path: str, msg: str):
        raise CostFileError(f"{self.name}: {path}: {msg}")

    def obj(self, obj, path) -> dict:
        if not isinstance(obj, dict):
            self.fail(path, f"expected an object, got {type(obj).__name__}")
        return obj

    def keys(self, obj, path, required, optional=()):
        for key in self.obj(obj, path):
            if key not in required and key not in optional:
                self.fail(path, f"unknown key {key!r}")
        for key in required:
            if key not in obj:
                self.fail(path, f"missing key {key!r}")
        if "estimated" in obj and obj["estimated"] not in self.rules:
            self.fail(f"{path}.estimated", f"names no rule: {obj['estimated']!r}")
        return obj

    def cost(self, value, path) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"expected a number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            self.fail(path, f"cost must be positive and finite, got {value!r}")
        return float(value)

    def ints(self, obj, path, what) -> list[int]:
        """The sorted integer keys of obj (strings of integers >= 1), at least two."""
        out = []
        for key in self.obj(obj, path):
            if not key.isdigit() or str(int(key)) != key or int(key) < 1:
                self.fail(path, f"{what} key {key!r} is not an integer >= 1")
            out.append(int(key))
        if len(out) < 2:
            self.fail(path, f"needs two or more {what} points, has {len(out)}")
        return sorted(out)

    def source(self, table, path):
        src = table["source"]
        if not isinstance(src, list) or (not src and "estimated" not in table):
            self.fail(f"{path}.source", "expected a non-empty list of {file, commit, what}")
        for i, entry in enumerate(src):
            self.keys(entry, f"{path}.source.{i}", ("file", "commit", "what"))

    def grid(self, obj, path, row_what, inner, col_what, optional=()):
        """A rectangular grid {row: {inner: {col: value}, *optional}}: (rows, cols); every row has
        the same cols."""
        rows = self.ints(obj, path, row_what)
        cols = None
        for r in rows:
            entry = self.keys(obj[str(r)], f"{path}.{r}", (inner,), optional)
            these = self.ints(entry[inner], f"{path}.{r}.{inner}", col_what)
            if cols is not None and these != cols:
                lacks, extra = sorted(set(cols) - set(these)), sorted(set(these) - set(cols))
                self.fail(f"{path}.{r}.{inner}", f"{col_what} points differ from {row_what} {rows[0]}'s: "
                                                 f"lacks {lacks}, has extra {extra}")
            cols = these
        return rows, cols


def _talker(rd: _Reader, t: dict, path: str):
    rd.keys(t, path, ("source", "buckets", "floor_ms_per_frame"))
    rd.source(t, path)
    flags = ("estimated", "raised_to_floor")
    buckets, ks = rd.grid(t["buckets"], f"{path}.buckets", "bucket", "k", "K", flags)
    for b in buckets:
        entry = t["buckets"][str(b)]
        if b & (b - 1):
            rd.fail(f"{path}.buckets.{b}", "a talker bucket must be a power of two")
        if entry.get("raised_to_floor", True) is not True:
            rd.fail(f"{path}.buckets.{b}.raised_to_floor", "must be true when present")
    if ks[0] != 1:
        rd.fail(f"{path}.buckets", f"K points must include 1, have {ks}")
    floors = t["floor_ms_per_frame"]
    floor_buckets = rd.ints(floors, f"{path}.floor_ms_per_frame", "bucket")
    for b in sorted(set(floor_buckets) - set(buckets)):
        rd.fail(f"{path}.buckets", f"no bucket {b} (floor_ms_per_frame has one)")
    for b in sorted(set(buckets) - set(floor_buckets)):
        rd.fail(f"{path}.floor_ms_per_frame", f"no floor for bucket {b}")
    table = {}
    for b in buckets:
        fpath = f"{path}.floor_ms_per_frame.{b}"
        floor = rd.cost(rd.keys(floors[str(b)], fpath, ("ms",), ("estimated",))["ms"], f"{fpath}.ms")
        points = []
        for k in ks:
            ms = rd.cost(t["buckets"][str(b)]["k"][str(k)], f"{path}.buckets.{b}.k.{k}")
            if ms < k * floor:
                rd.fail(f"{path}.buckets.{b}.k.{k}", f"{ms} ms is below K x floor = {k * floor} ms")
            points.append((k, ms))
        table[b] = tuple(points)
    return table


def _rows_cols(rd: _Reader, obj, path, row_what, inner, col_what, column=None):
    """((row, ((col, value), ...)), ...) of a rectangular grid; column picks a key of each cell."""
    rows, cols = rd.grid(obj, path, row_what, inner, col_what)
    out = []
    for r in rows:
        cells = []
        for c in cols:
            cpath, cell = f"{path}.{r}.{inner}.{c}", obj[str(r)][inner][str(c)]
            if column is not None:
                cell = rd.keys(cell, cpath, ("graph", "eager"))[column]
                cpath = f"{cpath}.{column}"
            cells.append((c, rd.cost(cell, cpath)))
        out.append((r, tuple(cells)))
    return tuple(out)


def _prefill(rd: _Reader, t: dict, path: str):
    rd.keys(t, path, ("source", "rows", "launch_ms"))
    rd.source(t, path)
    grid = _rows_cols(rd, t["rows"], f"{path}.rows", "row", "tokens", "token")
    return grid, rd.cost(t["launch_ms"], f"{path}.launch_ms")


def _prefill_graphed(rd: _Reader, t: dict, path: str):
    """(ms per prompt token, weight-read floor ms) of a graphed prefill call (estimated)."""
    rd.keys(t, path, ("source", "estimated", "ms_per_token", "weight_floor_ms"))
    rd.source(t, path)
    return rd.cost(t["ms_per_token"], f"{path}.ms_per_token"), rd.cost(t["weight_floor_ms"],
                                                                      f"{path}.weight_floor_ms")


def _codec(rd: _Reader, t: dict, path: str):
    rd.keys(t, path, ("source", "batches"))
    rd.source(t, path)
    graph = _rows_cols(rd, t["batches"], f"{path}.batches", "batch", "frames", "frame", "graph")
    eager = _rows_cols(rd, t["batches"], f"{path}.batches", "batch", "frames", "frame", "eager")
    return graph, eager, eager[0][1][0][1]  # the last: the smallest (batch, frames) eager call


def _copy(rd: _Reader, t: dict, path: str):
    rd.keys(t, path, ("source", "GBps", "latency_ms"), ("estimated",))
    rd.source(t, path)
    return rd.cost(t["GBps"], f"{path}.GBps"), rd.cost(t["latency_ms"], f"{path}.latency_ms")


def _sharing(rd: _Reader, t: dict, path: str):
    rd.keys(t, path, ("source", "mps_off", "mps_on"))
    rd.source(t, path)
    out = {}
    for mode in ("mps_off", "mps_on"):
        entry = rd.keys(t[mode], f"{path}.{mode}", ("talker", "codec"))
        out[mode] = (rd.cost(entry["talker"], f"{path}.{mode}.talker"),
                     rd.cost(entry["codec"], f"{path}.{mode}.codec"))
    return out


CHECKS = {"talker_step": _talker, "prefill": _prefill, "prefill_graphed": _prefill_graphed, "codec": _codec,
          "copy": _copy, "sharing": _sharing}


def validate(doc, name: str) -> dict[str, dict[str, object]]:
    """Every profile's parsed tables, {profile: {slot: parsed}}; CostFileError on the first fault."""
    rd = _Reader(name, {})
    rd.keys(doc, "(top)", tuple(sorted(TOP_KEYS)))
    if doc["format"] != 1 or isinstance(doc["format"], bool):
        rd.fail("format", f"expected 1, got {doc['format']!r}")
    rules = rd.rules = rd.obj(doc["rules"], "rules")
    tables = rd.obj(doc["tables"], "tables")
    profiles = rd.obj(doc["profiles"], "profiles")
    for prof in profiles:
        if prof not in PROFILES:
            rd.fail("profiles", f"unknown profile {prof!r} (known: {', '.join(PROFILES)})")
    kinds: dict[str, str] = {}
    for prof, slots in profiles.items():
        rd.keys(slots, f"profiles.{prof}", SLOTS)
        for slot in SLOTS:
            table = slots[slot]
            if table not in tables:
                rd.fail(f"profiles.{prof}.{slot}", f"names a missing table {table!r}")
            if kinds.setdefault(table, slot) != slot:
                rd.fail(f"profiles.{prof}.{slot}", f"table {table!r} is also named as a {kinds[table]} table")
    for table in tables:
        if table not in kinds:
            rd.fail(f"tables.{table}", "no profile names this table")
    for rule in ("replay_launch", "step_launch", "gil_ops", "graphed_prefill_launch"):
        if rule not in rules:
            rd.fail("rules", f"missing rule {rule!r} (a host launch time the loader serves)")
    parsed = {t: CHECKS[kind](rd, tables[t], f"tables.{t}") for t, kind in kinds.items()}
    return {prof: {slot: (slots[slot], parsed[slots[slot]]) for slot in SLOTS}
            for prof, slots in profiles.items()}


@dataclass(frozen=True)
class DeviceCosts:
    """One profile of a cost file; all times in ms."""

    profile: str
    path: str
    sha256: str
    _tables: dict = field(repr=False, compare=False)

    def _err(self, slot: str, key: str, msg: str):
        raise CostFileError(f"{Path(self.path).name}: tables.{self._tables[slot][0]}.{key}: {msg}")

    def talker_step_ms(self, bucket: int, k: int) -> float:
        """One decode step of K frames at a captured bucket of rows."""
        table = self._tables["talker_step"][1]
        if bucket not in table:
            self._err("talker_step", "buckets", f"no bucket {bucket}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return _pwl(table[bucket], k)

    def check_talker_buckets(self, buckets) -> None:
        table = self._tables["talker_step"][1]
        for b in buckets:
            if b not in table:
                self._err("talker_step", "buckets", f"no bucket {b}")

    def prefill_ms(self, rows: int, tokens: int) -> float:
        """One eager prefill call of rows prompts padded to tokens tokens."""
        if rows < 1 or tokens < 1:
            raise ValueError(f"prefill needs rows >= 1 and tokens >= 1, got ({rows}, {tokens})")
        grid, launch = self._tables["prefill"][1]
        return max(launch, _pwl(tuple((r, _pwl(cells, tokens)) for r, cells in grid), rows))

    def prefill_host_ms(self, rows: int, tokens: int) -> float:
        return min(self.prefill_ms(rows, tokens), self._tables["prefill"][1][1])

    def prefill_graphed_ms(self, rows: int, tokens: int) -> float:
        """One graphed prefill call of rows prompt chunks padded to tokens positions (estimated,
        rule graphed_prefill): the larger of the backbone's weight read and rows x tokens at the
        per-token time of the largest measured eager call (a compute-bound shape graphs cannot
        shorten much)."""
        if rows < 1 or tokens < 1:
            raise ValueError(f"prefill needs rows >= 1 and tokens >= 1, got ({rows}, {tokens})")
        per_token, weights = self._tables["prefill_graphed"][1]
        return max(weights, per_token * rows * tokens)

    def prefill_burst_floor_ms(self, lengths) -> float:
        """The prefill compute floor of a burst: the least device time that prefills prompts of
        these lengths (tokens each) under rule graphed_prefill, whatever the packing into calls:
        every call costs at least its tokens at the per-token time and at least one weight read,
        so no schedule beats max(weight read, all tokens x per-token time)."""
        lengths = list(lengths)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"lengths must be one or more prompt lengths >= 1, got {lengths[:8]}")
        per_token, weights = self._tables["prefill_graphed"][1]
        return max(weights, per_token * sum(lengths))

    @staticmethod
    def prefill_graphed_ops(rows: int) -> int:
        return GRAPHED_PREFILL_OPS

    def prefill_graphed_host_ms(self, rows: int) -> float:
        """A graphed prefill call's host launch and staging (rule graphed_prefill_launch)."""
        return GRAPHED_PREFILL_OPS * EAGER_OP_MS + REPLAY_LAUNCH_MS

    def codec_ms(self, batch: int, frames: int, graph: bool) -> float:
        """One Code2Wav call of batch streams x frames frames: a graph replay padded to its batch
        bucket, or eager."""
        if batch < 1 or frames < 1:
            raise ValueError(f"codec needs batch >= 1 and frames >= 1, got ({batch}, {frames})")
        graphs, eager, smallest = self._tables["codec"][1]
        if not graph:
            return max(smallest, _pwl(tuple((b, _pwl(cells, frames)) for b, cells in eager), batch))
        measured = [t for t, _ in graphs[0][1]]
        if frames not in measured:
            self._err("codec", "batches", f"no graph for T={frames} (measured T: {measured})")
        for b, cells in graphs:
            if b >= batch:
                return dict(cells)[frames]
        self._err("codec", "batches", f"no graph for B={batch}, T={frames} (largest batch {graphs[-1][0]})")

    @staticmethod
    def step_ops(k: int) -> int:
        return STEP_OPS + k * (1 + STEP_OPS_PER_FRAME)

    @staticmethod
    def prefill_ops(rows: int) -> int:
        return PREFILL_OPS + PREFILL_OPS_PER_ROW * rows

    @staticmethod
    def codec_ops(graph: bool) -> int:
        return CODEC_GRAPH_OPS if graph else CODEC_EAGER_OPS

    def step_launch_ms(self, k: int) -> float:
        """A talker decode step's host launches: its gathers, scatters and copies, K replays."""
        return STEP_OPS * EAGER_OP_MS + k * (REPLAY_LAUNCH_MS + STEP_OPS_PER_FRAME * EAGER_OP_MS)

    def codec_host_ms(self, batch: int, frames: int, graph: bool) -> float:
        if graph:
            return REPLAY_LAUNCH_MS
        return min(self.codec_ms(batch, frames, False), self._tables["codec"][1][2])

    def d2h_ms(self, nbytes: int) -> float:
        gbps, latency = self._tables["copy"][1]
        return latency + nbytes / (gbps * 1e9) * 1e3

    def slowdown(self, mps: bool) -> tuple[float, float]:
        """(talker, codec): each process's rate alone over its rate when both run at once."""
        return self._tables["sharing"][1]["mps_on" if mps else "mps_off"]


def load_costs(path=DEFAULT_PATH, profile: str = "tip") -> DeviceCosts:
    path = Path(path)
    data = path.read_bytes()
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise CostFileError(f"{path.name}: (top): not JSON: {exc}") from None
    profiles = validate(doc, path.name)
    if profile not in profiles:
        raise CostFileError(f"{path.name}: profiles: unknown profile {profile!r} (has {sorted(profiles)})")
    return DeviceCosts(profile, str(path), hashlib.sha256(data).hexdigest(), profiles[profile])
