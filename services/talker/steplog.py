"""The talker's step log (``engine.step_log``): one JSON line per collected step, for tuning the
pacing on a machine (what each step planned, what it took, how close its rows ran to their
listeners). Off by default; a file of the operator's choosing, created mode 0600, appended."""

from __future__ import annotations

import json
import os
from typing import IO


class StepLog:
    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file: IO[str] | None = os.fdopen(fd, "w", buffering=1)  # a line at a time

    def write(self, entry: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
