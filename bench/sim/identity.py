"""``python -m bench.sim.identity OUT.json [RUNS] [TIERS]``: the calibration's runs with the
lanes' measured CPU replaced by a counter (10 us a call to the thread clock, per thread), so
the tiers are bit-reproducible. The simulator measures its host work, so two runs of one
version differ by up to ~20% a tier (calibration.json against a re-run); two versions that
make the same lane operations in the same order give equal files here. Used to show a change
to the simulator leaves today's loop simulated as it was (compare the files, less new keys)."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import types

from bench.sim import calibrate, kernel
from bench.sim.run import run_tiers

TICK_S = 1e-5


def counted_clock():
    """A thread clock that advances TICK_S a call, separately on each thread."""
    local = threading.local()

    def thread_time() -> float:
        local.n = getattr(local, "n", 0) + 1
        return local.n * TICK_S
    return types.SimpleNamespace(thread_time=thread_time)


def run(names: list[str], tiers: tuple[int, ...]) -> dict:
    real, kernel.time = kernel.time, counted_clock()
    try:
        out = {}
        for name in names:
            path, profile = calibrate.RUNS[name]
            spec = dataclasses.replace(calibrate.spec_for(json.loads(path.read_text()), profile), tiers=tiers)
            out[name] = {str(c): {k: v for k, v in r.items() if k != "sim_cpu_s"}
                         for c, r in run_tiers(spec).items()}
            for record in out[name].values():
                record.get("numbers", {}).pop("sim_cpu_s", None)
        return out
    finally:
        kernel.time = real


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 3:
        raise SystemExit(__doc__.split("\n\n")[0])
    names = (argv[1] if len(argv) > 1 else "calibration,held_out_poisson_mps_off").split(",")
    tiers = tuple(int(t) for t in (argv[2] if len(argv) > 2 else "8,64,256").split(","))
    unknown = [n for n in names if n not in calibrate.RUNS]
    if unknown:
        raise SystemExit(f"runs: unknown {', '.join(unknown)} (known: {', '.join(calibrate.RUNS)})")
    with open(argv[0], "w") as f:
        json.dump(run(names, tiers), f, indent=1, sort_keys=True, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
