"""Prometheus metrics of a stage process, served at ``http://<metrics.listen>/metrics``.

One registry per process. Every stage counts RPCs and their error statuses (the server
interceptor does it); each stage adds its own numbers as a collector read at scrape
time (engine counters and gauges: active streams, queue depth, frames, audio seconds),
so nothing is updated on the hot path just for metrics. The gateway also records time
to first audio in a histogram.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from services.common.config import ConfigValueError
from services.common.sections import parse_listen

REGISTRY = CollectorRegistry()
RPC_ERRORS = Counter("voxring_rpc_errors", "RPCs that ended with an error status",
                     ["method", "code"], registry=REGISTRY)
TIME_TO_FIRST_AUDIO = Histogram(
    "voxring_time_to_first_audio_seconds", "From request arrival to its first audio chunk",
    buckets=(0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0), registry=REGISTRY)
CLEAR_TO_SILENCE = Histogram(
    "voxring_clear_to_silence_seconds",
    "A streaming session's clear (barge-in): from the client's clear to the cleared segment's end "
    "(its audio muted at once; its frames dropped on Code2Wav)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0), registry=REGISTRY)
SEGMENT_FIRST_AUDIO = Histogram(
    "voxring_segment_first_audio_seconds",
    "A streaming session's segment: from its text's completion (its last piece) to its first audio",
    buckets=(0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0), registry=REGISTRY)


@dataclass(frozen=True)
class MetricsSection:
    listen: str | None = None  # HOST:PORT of the /metrics endpoint (port 0: any free); null: off
    # a folder: SIGUSR2 starts a profile of the stage's device work, the next stops it, its summary
    # written here (services/common/device_profile.py); null: off
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        if self.profile_dir is not None and not self.profile_dir.strip():
            raise ConfigValueError("profile_dir", "must name a folder (or be null: no device profiles)")
        if self.listen is None:
            return
        try:
            _, port = parse_listen(self.listen)
        except ValueError as exc:
            raise ConfigValueError("listen", str(exc)) from None
        if port is None:
            raise ConfigValueError("listen", "metrics are served over HTTP: use HOST:PORT")


class StageCollector:
    """Turns a stage's ``snapshot() -> {name: (kind, help, value)}`` into metrics at
    scrape time; kind is "counter", "gauge" or "histogram" (value: ``(buckets, sum)``, buckets
    as ``[(upper edge, cumulative count), ...]`` ending with ``("+Inf", total)``)."""

    def __init__(self, snapshot: Callable[[], dict[str, tuple[str, str, float]]]) -> None:
        self.snapshot = snapshot

    def collect(self):
        for name, (kind, text, value) in self.snapshot().items():
            if kind == "histogram":
                buckets, total = value
                yield HistogramMetricFamily(f"voxring_{name}", text, buckets=buckets, sum_value=total)
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"voxring_{name}", text, value=value)


def register(snapshot: Callable[[], dict[str, tuple[str, str, float]]]) -> None:
    REGISTRY.register(StageCollector(snapshot))


def register_collector(collector) -> None:
    """A collector with its own families (labelled ones): ``collector.collect()`` at scrape time."""
    REGISTRY.register(collector)


def serve(section: MetricsSection) -> str | None:
    """Starts the /metrics endpoint; returns its address (None when off)."""
    if section.listen is None:
        return None
    host, port = parse_listen(section.listen)
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return f"{host}:{server.server_port}"
