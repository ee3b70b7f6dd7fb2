"""The server bench's profiled tier (bench/server/profile.py): py-spy's raw stacks summarized per
thread, then kept gzipped (the committed results travel to the GPU machine with the tree)."""

from __future__ import annotations

import gzip
import json

from bench.server.profile import RATE_HZ, TierProfile

RAW = ("thread (0x1): engine;step (engine.py:10);decode (engine.py:20);cudaEventSynchronize 30\n"
       "thread (0x1): engine;step (engine.py:10);cut (pacing.py:5) 10\n"
       "thread (0x2): main;run (loop.py:1);0x7f00 5\n")


class FinishedSpy:
    """A py-spy record that already ended well."""
    returncode = 0

    def communicate(self, timeout=None):
        return "", ""


def test_finish_summarizes_each_stage_s_threads_and_keeps_the_raw_stacks_gzipped(tmp_path):
    raw = tmp_path / "pyspy_talker_c2.txt"
    raw.write_text(RAW)
    lines = []
    profile = TierProfile(server=None, out=tmp_path, tier=2, seconds=1.0, log=lines.append)
    profile.procs = {"talker": (FinishedSpy(), raw)}
    summary = profile.finish()
    engine = summary["talker"]["threads"]["thread (0x1): engine"]
    assert engine["samples"] == 40 and engine["core_share"] == round(40 / RATE_HZ, 3)
    assert engine["leaf"] == {"cudaEventSynchronize": 0.75, "cut (pacing.py:5)": 0.25}
    assert summary["talker"]["threads"]["thread (0x2): main"]["leaf"] == {"run (loop.py:1)": 1.0}
    assert json.loads((tmp_path / "pyspy_c2.json").read_text()) == summary
    assert not raw.exists()
    with gzip.open(tmp_path / "pyspy_talker_c2.txt.gz", "rt") as kept:
        assert kept.read() == RAW
    assert lines and lines[0].startswith("profile: C=2: talker: thread (0x1): engine 80%")


def test_a_py_spy_that_failed_is_reported_and_nothing_is_gzipped(tmp_path):
    class Failed(FinishedSpy):
        returncode = 1

        def communicate(self, timeout=None):
            return "", "Permission denied"

    raw = tmp_path / "pyspy_gateway_c2.txt"
    profile = TierProfile(server=None, out=tmp_path, tier=2, seconds=1.0, log=lambda _: None)
    profile.procs = {"gateway": (Failed(), raw)}
    assert profile.finish() == {"gateway": {"error": "Permission denied"}}
    assert not list(tmp_path.glob("*.gz"))
