"""``python -m bench.server``: runs one part (the package docstring says which and how), then
prints and writes the report of everything in ``--out``."""

from __future__ import annotations

import shutil
import signal
import sys

from bench.server import log
from bench.server.args import parse_args
from bench.server.baseline import part_baseline
from bench.server.report import report
from bench.server.tiers import part_tiers


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every finally: stages stopped


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    s.out.mkdir(parents=True, exist_ok=True)
    if not s.smoke and s.part != "report" and shutil.which("nvidia-smi") is None:
        raise SystemExit("server_gpu: no nvidia-smi: this benchmark runs on the GPU machine (--smoke: CPU)")
    try:
        if s.part == "tiers":
            code = part_tiers(s)
        elif s.part == "baseline":
            code = part_baseline(s)
        else:
            code = 0
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc}); the results so far are in {s.out}")
        code = 130
    print(report(s.out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
