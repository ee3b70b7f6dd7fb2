"""Logging for service processes: one line per record, every line carrying the stage
and the request id of the RPC it belongs to (``-`` outside requests).

The request id lives in a context variable. grpc.aio runs each RPC in its own task, so
setting it in the RPC's task (the server interceptor does) tags everything that RPC
logs; engine threads set it around work they do for one request.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

LEVELS = ("debug", "info", "warning", "error")


class _RequestIdFilter(logging.Filter):
    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def filter(self, record: logging.LogRecord) -> bool:
        record.stage = self.stage
        record.request_id = request_id_var.get()
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "stage": record.stage,
            "request_id": record.request_id,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(stage: str, level: str = "info", as_json: bool = False) -> None:
    """Sends the root logger to stderr with the stage and request id on every line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter(stage))
    if as_json:
        handler.setFormatter(_JsonFormatter())
    else:
        formatter = logging.Formatter(
            "%(asctime)s.%(msecs)03dZ %(levelname)-7s %(stage)s [%(request_id)s] "
            "%(name)s: %(message)s",
            datefmt="%Y-%m-%dT%H:%M:%S",
        )
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Tags log lines inside the block with ``request_id``. Inside an async generator the
    block may end in another context: a cancelled streaming RPC's generator is closed by
    the loop's finalizer in a task of its own, where this context's value was never set
    (and the context that set it has ended with its task), so nothing is reset there."""
    token = request_id_var.set(request_id or "-")
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # "created in a different Context"
            request_id_var.reset(token)
