"""`voxring down` waits for the very process it signalled: identity by (pid, start time), since an
exiting process's cmdline reads empty before it becomes a zombie."""

from __future__ import annotations

import os
import subprocess
import sys

from voxring.processes import is_same_live_process, start_time


def test_a_process_is_live_until_it_exits_and_only_under_its_own_start_time():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        started = start_time(proc.pid)
        assert started is not None and started.isdigit()
        assert is_same_live_process(proc.pid, started)
        assert not is_same_live_process(proc.pid, str(int(started) + 1))  # another process, same pid
        assert not is_same_live_process(proc.pid, None)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert not is_same_live_process(proc.pid, started)  # reaped: gone
    assert start_time(proc.pid) is None or start_time(proc.pid) != started


def test_a_zombie_is_not_live():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    started = start_time(proc.pid)
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped: a zombie
        assert start_time(proc.pid) == started
        assert not is_same_live_process(proc.pid, started)
    finally:
        proc.wait(timeout=30)
