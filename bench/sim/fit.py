"""The simulator's two fitted parameters, fitted once against the calibration run (the
closed-loop burst of ee9c553 without MPS) by ``python -m bench.sim.calibrate --fit`` and
frozen here. Everything else in the model is measured or a stated rule (h200.json, host.py).

- ``grpc_factor``: the real stages' gRPC CPU per message and per call against the bare
  gRPC the host probe timed (one server, one client, 64 streams, no interceptors): the
  servers' interceptors, each call's task and request context, asyncio's wake-ups with
  hundreds of streams open. It multiplies every gRPC cost of every lane.
- ``call_overhead_s``: CPU a call costs the event loop that serves it beyond that (the
  servicer's own code around it): the gateway's Synthesize, Code2Wav's Open, the
  talker's Submit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fit:
    grpc_factor: float
    call_overhead_s: float

    def __post_init__(self) -> None:
        if not 1 <= self.grpc_factor <= 10:
            raise ValueError(f"grpc_factor must be in [1, 10], got {self.grpc_factor}")
        if not 0 <= self.call_overhead_s < 1:
            raise ValueError(f"call_overhead_s must be in [0, 1) seconds, got {self.call_overhead_s}")


# The grid's best (bench/results/sim/fit_search.json): every calibration tier within the bar.
FIT = Fit(grpc_factor=2.5, call_overhead_s=0.00015)
