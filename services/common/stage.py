"""Entry point shared by the stage processes: ``python -m services.<stage> --config FILE``.

Loads the stage's strict config (errors exit 2 with the file and key named), sets up
logging, builds the stage's services and runs them in a :class:`ServiceHost` until
SIGTERM/SIGINT, then exits 0 after the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from services.common import metrics
from services.common.config import ConfigError, load_config
from services.common.device_profile import stop_installed
from services.common.gc_pauses import GcPauses, freeze_startup
from services.common.log import configure_logging
from services.common.metrics import serve as serve_metrics
from services.common.sections import read_tls_files
from services.common.server import ServiceHost

C = TypeVar("C")

# build(config, config_path) -> (services, components) or (services, components, host options)
Builder = Callable[[Any, Path | None], tuple]


def exit_stage(code: int) -> None:
    """Ends the stage process with ``code`` once its logs are flushed, skipping the interpreter's
    teardown: after the drain every resource the stage holds (rings, sockets, the ready file, its
    children) is released, and tearing down torch's modules only costs time (about 0.7 s of a
    talker's stop), which a restart under load and every test that stops a stage wait for."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run_stage(stage: str, config_cls: type[C], build: Builder, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m services.{stage}",
                                     description=f"voxring {stage} service")
    parser.add_argument("--config", type=Path, default=None,
                        help=f"YAML config (default: built-in defaults); "
                             f"VOXRING_{stage.upper()}__<SECTION>__<KEY> overrides it")
    parser.add_argument("--ready-file", type=Path, default=None,
                        help="write {stage, address, pid} as JSON here once serving")
    args = parser.parse_args(argv)
    try:
        config = load_config(config_cls, args.config, stage)
        read_tls_files(config.server)  # before build, which may load a model: fail fast
    except ConfigError as exc:
        print(f"voxring {stage}: config error: {exc}", file=sys.stderr)
        return 2
    configure_logging(stage, config.logging.level, config.logging.json)
    metrics.register(GcPauses().install().metrics)  # every stage: a collection stops its loop and engine
    try:
        built = build(config, args.config)
        services, components, options = (*built, {}) if len(built) == 2 else built
        # Reads and checks server.tls_cert / server.tls_key when they are set.
        host = ServiceHost(stage, config.server, services, components, args.ready_file, **options)
    except ConfigError as exc:
        print(f"voxring {stage}: config error: {exc}", file=sys.stderr)
        return 2
    freeze_startup()  # the model, graphs and modules built: full collections walk only what serving makes
    try:
        host.metrics_address = serve_metrics(config.metrics)
    except OSError as exc:
        logging.getLogger(stage).error("cannot serve metrics on %s: %s", config.metrics.listen, exc)
        return 1
    if host.metrics_address:
        logging.getLogger(stage).info("metrics at http://%s/metrics", host.metrics_address)
    try:
        asyncio.run(host.run())
    except OSError as exc:
        logging.getLogger(stage).error("cannot serve: %s", exc)
        return 1
    finally:
        stop_installed()  # a device profile still running when the stage stops is written, not lost
    return host.exit_code
