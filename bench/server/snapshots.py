"""A stage's numbers as the server bench reads them: /metrics scraped into flat samples, a snapshot
of every stage, and a tier's differences between two snapshots."""

from __future__ import annotations

import contextlib
import re
import urllib.request
from dataclasses import dataclass, field

BUCKET = re.compile(r'(?P<name>\w+_bucket)\{le="(?P<le>[^"]+)"\}')


@dataclass
class Snapshot:
    at: float
    stats: dict
    metrics: dict[str, dict[str, float]]
    cpu: dict[str, float | None]
    talkers: list[str]
    code2wavs: list[str]
    threads: dict[str, dict[str, float]]
    gateways: list[str] = field(default_factory=lambda: ["gateway"])  # the gateway stages' names


def scrape(address: str | None) -> dict[str, float]:
    """Unlabelled samples of a stage's /metrics (name -> value) and histograms' buckets (name@le ->
    count); {} when off or unreachable."""
    if not address:
        return {}
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.partition(" ")
        if "{" in name:  # of labelled samples, a histogram's buckets only, as name@le
            bucket = BUCKET.fullmatch(name)
            if bucket is None:
                continue
            name = f"{bucket['name']}@{bucket['le']}"
        with contextlib.suppress(ValueError):
            out[name] = float(value.split()[0])
    return out


def sample(metrics: dict[str, float], name: str) -> float | None:
    for key in (f"voxring_{name}_total", f"voxring_{name}"):
        if key in metrics:
            return metrics[key]
    return None


def delta(before: Snapshot, after: Snapshot, stage: str, name: str) -> float | None:
    a, b = sample(before.metrics[stage], name), sample(after.metrics[stage], name)
    return None if a is None or b is None else b - a


def summed(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values)


def share_over(before: Snapshot, after: Snapshot, stage: str, name: str, edge: str) -> float | None:
    """The share of a histogram's observations over the tier above the bucket edge ``edge``."""
    count = delta(before, after, stage, f"{name}_count")
    within = delta(before, after, stage, f"{name}_bucket@{edge}")
    return None if not count or within is None else round(1 - within / count, 4)


def gc_pauses(before: Snapshot, after: Snapshot) -> dict:
    """Each stage's garbage collections over the tier (services/common/gc_pauses.py): how many, how
    many stopped it longer than 25 ms, their seconds in all, and the full ones' count."""
    out = {}
    for stage in after.metrics:
        count = delta(before, after, stage, "gc_pause_seconds_count")
        if count is None:
            continue  # a stage without the histogram (older)
        within = delta(before, after, stage, "gc_pause_seconds_bucket@0.025")
        seconds = delta(before, after, stage, "gc_pause_seconds_sum")
        out[stage] = {"pauses": int(count), "over_25ms": None if within is None else int(count - within),
                      "seconds": None if seconds is None else round(seconds, 4),
                      "full": delta(before, after, stage, "gc_full_pause_seconds_count")}
    return out
