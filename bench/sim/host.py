"""The host side of the cost model: gRPC's CPU per message and the host factor, from the
host probe's result files (``host_probe.py``)."""

from __future__ import annotations

from bench.sim.engines import HostCosts


def load_host_costs() -> HostCosts:
    # placeholder until the probe's files land
    return HostCosts(unary_server_s=150e-6, unary_client_s=150e-6, stream_send_s=(60e-6, 1e-9),
                     stream_recv_s=(60e-6, 1e-9))
