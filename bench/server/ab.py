"""Two runs of the server bench side by side, tier by tier: an A/B read in one table (the arms of
``bench/server/run41.sh``, or two campaigns' folders) instead of two tables read by eye.

    python -m bench.server.ab OLD_FOLDER NEW_FOLDER [--mode mps-on-poisson]

Each folder holds ``server_gpu_tiers_<mode>.json`` (one such file, or ``--mode`` names it). For
each tier both ran: admitted / refused, TTFA p50 / p90 / p99, underruns, the steady rate, the
gateway's own TTFA mean and the talker's first record in its parts (wait, prefill, step), Code2Wav's
first chunk, the talker's step and K, each as old -> new with the change. Tiers only one ran are
listed below the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (column, how to read it from a tier, digits)
COLUMNS = (
    ("admitted", lambda t: t.get("admitted"), 0),
    ("refused", lambda t: t.get("rejected"), 0),
    ("TTFA p50", lambda t: (t.get("ttfa_ms") or {}).get("p50"), 1),
    ("TTFA p90", lambda t: (t.get("ttfa_ms") or {}).get("p90"), 1),
    ("TTFA p99", lambda t: (t.get("ttfa_ms") or {}).get("p99"), 1),
    ("underruns", lambda t: t.get("underruns"), 0),
    ("steady audio-s/s", lambda t: t.get("steady_audio_s_per_s"), 1),
    ("gateway TTFA mean", lambda t: (t.get("gateway") or {}).get("server_ttfa_mean_ms"), 1),
    ("first record: wait", lambda t: _first(t, "wait"), 1),
    ("prefill", lambda t: _first(t, "prefill"), 1),
    ("step", lambda t: _first(t, "step"), 1),
    ("C2W first chunk", lambda t: (t.get("code2wav") or {}).get("first_chunk_ms"), 1),
    ("step ms", lambda t: (t.get("talker") or {}).get("step_ms"), 1),
    ("mean K", lambda t: (t.get("talker") or {}).get("mean_k"), 2),
)


def _first(tier: dict, part: str) -> float | None:
    return ((tier.get("talker") or {}).get("first_record_ms") or {}).get(part)


def tiers_file(folder: Path, mode: str | None) -> Path:
    """The folder's result file of ``mode`` (None: its only one)."""
    if mode is not None:
        path = folder / f"server_gpu_tiers_{mode}.json"
        if not path.is_file():
            raise SystemExit(f"{folder}: no server_gpu_tiers_{mode}.json")
        return path
    found = sorted(folder.glob("server_gpu_tiers_*.json"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise SystemExit(f"{folder}: {len(found)} result files ({names}); name one with --mode")
    return found[0]


def cell(old, new, digits: int) -> str:
    """"old -> new (+change)"; one side alone where the other is missing."""
    def show(v):
        return "-" if v is None else f"{v:,.{digits}f}"

    if old is None or new is None:
        return f"{show(old)} -> {show(new)}"
    change = new - old
    return f"{show(old)} -> {show(new)} ({'+' if change >= 0 else ''}{change:,.{digits}f})"


def ab_table(old: dict, new: dict) -> list[str]:
    """The markdown lines: a row per tier both ran, a column per measure."""
    both = sorted(set(old["tiers"]) & set(new["tiers"]), key=int)
    lines = [f"A/B: {old.get('commit')} ({old.get('mode')}) -> {new.get('commit')} ({new.get('mode')})", "",
             "| C | " + " | ".join(name for name, _, _ in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for c in both:
        a, b = old["tiers"][c], new["tiers"][c]
        cells = (cell(get(a), get(b), digits) for _, get, digits in COLUMNS)
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for label, data, other in (("old", old, new), ("new", new, old)):
        alone = sorted(set(data["tiers"]) - set(other["tiers"]), key=int)
        if alone:
            lines.append(f"\nOnly in {label}: tiers {', '.join(alone)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--mode", default=None, help="the result files' mode, e.g. mps-on-poisson")
    args = parser.parse_args(argv)
    old, new = (json.loads(tiers_file(folder, args.mode).read_text()) for folder in (args.old, args.new))
    print("\n".join(ab_table(old, new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
