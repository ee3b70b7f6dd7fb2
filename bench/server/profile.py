"""Where each stage's threads spend a tier (``--profile-tier C``): py-spy samples every thread
of the talker, Code2Wav and the gateway for ``--profile-seconds`` from the tier's first send,
native frames included (each sample stops the process briefly), so that "one core busy" can
be told apart as work or a spin in a driver wait (py-spy travels as a wheel:
bench/server/fetch_wheels.sh). py-spy samples a thread
only while it runs on a CPU, so a thread's samples over ``seconds x RATE_HZ`` is the share of a
core it used. The raw stacks (``pyspy_<stage>_c<C>.txt.gz``, gzipped once read: ~10x smaller in
the committed results, whose tree travels to the GPU machine) and a summary per thread
(``pyspy_c<C>.json``: its share of a core, its hottest leaf frames and the frames it spends most
time under) are written to ``--out``. With ``--profile-device`` each engine stage also profiles its
device work over the same window (its config's ``metrics.profile_dir``, set by the bench then;
SIGUSR2 starts and stops it: services/common/device_profile.py), copied to
``device_<stage>_c<C>.json`` (its busy share, time by kind, top kernels): stopping it held an
engine thread for seconds under load (bench notes, run 27). Off unless asked: it takes some host
time from the stages."""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from bench.server.procs import Server

RATE_HZ = 50  # each sample stops the process to unwind native frames: kept rare
STAGES = ("talker", "code2wav", "gateway")
ENGINES = ("talker", "code2wav")
DEVICE_PROFILE_WAIT_S = 60.0  # a stage's summary of its device profile is written within this


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
        self.device: dict[str, Path] = {}  # engine stage -> its profile folder, once signalled
        self._device_lock = threading.Lock()
        self._device_running = False
        self._device_timer: threading.Timer | None = None

    def start(self) -> None:
        self._device_start()
        exe = py_spy()
        if exe is None:
            self.log("profile: py-spy not found; this tier is not profiled")
            return
        for stage in STAGES:
            for name in self.server.names(stage):
                raw = self.out / f"pyspy_{name}_c{self.tier}.txt"
                cmd = [exe, "record", "--pid", str(self.server.procs[name].pid), "--duration",
                       str(max(1, round(self.seconds))), "--rate", str(RATE_HZ), "--format", "raw",
                       "--native", "--threads", "--output", str(raw)]
                self.procs[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                     text=True), raw)

    def _markers(self, name: str, suffix: str) -> list[Path]:
        """The stage's files of ``suffix`` in its profile folder (named by its pid)."""
        return list(self.device[name].glob(f"*-{self.server.procs[name].pid}-*{suffix}"))

    def _device_start(self) -> None:
        """SIGUSR2 to each engine stage that profiles its device work (metrics.profile_dir), each
        awaited until its profile started (its ``.started`` marker, bounded: the load begins after),
        and again ``seconds`` later (py-spy's window)."""
        before = {}
        for stage in ENGINES:
            for name in self.server.names(stage):
                folder = self.server.configs[name].get("metrics", {}).get("profile_dir")
                if folder:
                    self.device[name] = Path(folder)
                    before[name] = len(self._markers(name, ".started"))
                    self.server.procs[name].proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + DEVICE_PROFILE_WAIT_S
        for name, count in before.items():
            while len(self._markers(name, ".started")) <= count and time.monotonic() < deadline:
                time.sleep(0.05)
            if len(self._markers(name, ".started")) <= count:
                self.log(f"device profile: {name} did not start one within {DEVICE_PROFILE_WAIT_S:.0f} s")
        if self.device:
            self._device_running = True
            self._device_timer = threading.Timer(self.seconds, self._device_stop)
            self._device_timer.daemon = True
            self._device_timer.start()

    def _device_stop(self) -> None:
        """The second SIGUSR2, once (from the timer or from finish, whichever comes first)."""
        with self._device_lock:
            if not self._device_running:
                return
            self._device_running = False
            for name in self.device:
                self.server.procs[name].proc.send_signal(signal.SIGUSR2)

    def finish(self) -> dict:
        device = self._device_finish()
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
            _gzip(raw)
        if summary:
            (self.out / f"pyspy_c{self.tier}.json").write_text(json.dumps(summary, indent=1) + "\n")
            self.log(f"profile: C={self.tier}: " + "; ".join(_line(n, v) for n, v in summary.items()))
        return {**summary, **({"device": device} if device else {})}

    def _device_finish(self) -> dict:
        """Stops the engines' device profiles once py-spy's window has passed; their summaries,
        each copied to ``device_<stage>_c<C>.json``, by stage."""
        if not self.device:
            return {}
        self._device_timer.cancel()
        self._device_stop()  # where the tier ended before the window did
        out, deadline = {}, time.monotonic() + DEVICE_PROFILE_WAIT_S
        for name in self.device:
            written = sorted(self._markers(name, ".json"), key=lambda p: p.stat().st_mtime)
            while not written and time.monotonic() < deadline:  # the stage writes it on a thread
                time.sleep(0.1)
                written = sorted(self._markers(name, ".json"), key=lambda p: p.stat().st_mtime)
            if not written:
                out[name] = {"error": f"no device profile within {DEVICE_PROFILE_WAIT_S:.0f} s"}
                continue
            data = json.loads(written[-1].read_text())
            (self.out / f"device_{name}_c{self.tier}.json").write_text(json.dumps(data, indent=1) + "\n")
            out[name] = {k: data.get(k) for k in ("device", "window_s", "busy_share", "kinds_ms")}
            out[name]["top"] = [(k["name"][:60], k["total_ms"]) for k in data.get("kernels", [])[:5]]
        self.log(f"device profile: C={self.tier}: " + "; ".join(
            f"{n}: {v['error']}" if "error" in v else f"{n}: busy {v.get('busy_share')}, {v.get('kinds_ms')}"
            for n, v in out.items()))
        return out


def _gzip(path: Path) -> None:
    """``path`` replaced by ``path.gz``."""
    with path.open("rb") as src, gzip.open(path.with_name(path.name + ".gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()


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
