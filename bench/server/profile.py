"""Where each stage's threads spend a tier (``--profile-tier C``): py-spy samples every thread
of the talker, Code2Wav and the gateway for ``--profile-seconds`` from the tier's first send,
native frames included (each sample stops the process briefly), so that "one core busy" can
be told apart as work or a spin in a driver wait (py-spy travels as a wheel:
bench/server/fetch_wheels.sh). py-spy samples a thread
only while it runs on a CPU, so a thread's samples over ``seconds x RATE_HZ`` is the share of a
core it used. The raw stacks (``pyspy_<stage>_c<C>.txt``) and a summary per thread
(``pyspy_c<C>.json``: its share of a core, its hottest leaf frames and the frames it spends most
time under) are written to ``--out``. Off unless asked: it takes some host time from the stages."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench.server.procs import Server

RATE_HZ = 50  # each sample stops the process to unwind native frames: kept rare
STAGES = ("talker", "code2wav", "gateway")


def py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside this Python's scripts, or under PYTHONPATH's
    ``--target`` install (``/tmp/site/bin``)."""
    found = shutil.which("py-spy")
    if found:
        return found
    for folder in [Path(sys.executable).parent, *(Path(p) / "bin" for p in sys.path if p)]:
        if (folder / "py-spy").is_file():
            return str(folder / "py-spy")
    return None


class TierProfile:
    """py-spy on each stage for ``seconds`` from :meth:`start`; :meth:`finish` waits for them
    (bounded) and writes the summary. Does nothing where py-spy is missing (says so)."""

    def __init__(self, server: Server, out: Path, tier: int, seconds: float, log) -> None:
        self.server, self.out, self.tier, self.seconds, self.log = server, out, tier, seconds, log
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start(self) -> None:
        exe = py_spy()
        if exe is None:
            self.log("profile: py-spy not found; this tier is not profiled")
            return
        for stage in STAGES:
            for name in self.server.names(stage) if stage != "gateway" else ["gateway"]:
                raw = self.out / f"pyspy_{name}_c{self.tier}.txt"
                cmd = [exe, "record", "--pid", str(self.server.procs[name].pid), "--duration",
                       str(max(1, round(self.seconds))), "--rate", str(RATE_HZ), "--format", "raw",
                       "--native", "--threads", "--output", str(raw)]
                self.procs[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                     text=True), raw)

    def finish(self) -> dict:
        summary = {}
        for name, (proc, raw) in self.procs.items():
            try:
                _, err = proc.communicate(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode != 0 or not raw.is_file():
                summary[name] = {"error": (err or "").strip()[-400:] or f"exit {proc.returncode}"}
                continue
            summary[name] = summarize(raw.read_text(), self.seconds * RATE_HZ)
        if summary:
            (self.out / f"pyspy_c{self.tier}.json").write_text(json.dumps(summary, indent=1) + "\n")
            self.log(f"profile: C={self.tier}: " + "; ".join(_line(n, v) for n, v in summary.items()))
        return summary


def _line(name: str, summary: dict) -> str:
    if "threads" not in summary:
        return f"{name}: {summary['error']}"
    return f"{name}: " + ", ".join(f"{t} {s['core_share']:.0%}" for t, s in summary["threads"].items())


def summarize(raw: str, ticks: float, top: int = 12) -> dict:
    """py-spy's raw output (``thread (tid): name;frame;... count``, the root first) by thread:
    its share of a core (samples / ``ticks``), the hottest leaves (native ones included), the
    innermost Python frames and the frames most time is spent under, as shares of that thread's
    samples."""
    threads: dict[str, dict] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        frames = [f for f in frames if not f.startswith("0x")]  # unnamed native frames
        entry = threads.setdefault(thread, {"samples": 0, "leaf": Counter(), "py": Counter(),
                                            "under": Counter()})
        n = int(count)
        entry["samples"] += n
        entry["leaf"][frames[-1] if frames else "?"] += n
        entry["py"][next((f for f in reversed(frames) if ".py:" in f), "?")] += n
        for frame in set(frames):
            entry["under"][frame] += n
    out = {}
    for thread, e in sorted(threads.items(), key=lambda item: -item[1]["samples"]):
        samples = e["samples"]
        out[thread] = {"samples": samples, "core_share": round(samples / ticks, 3),
                       "leaf": {f: round(n / samples, 3) for f, n in e["leaf"].most_common(top)},
                       "python": {f: round(n / samples, 3) for f, n in e["py"].most_common(top)},
                       "under": {f: round(n / samples, 3) for f, n in e["under"].most_common(top * 2)}}
    return {"threads": out}
