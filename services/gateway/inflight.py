"""Request ids in flight at this gateway: a second request with the same id while the
first runs is refused with ALREADY_EXISTS (docs/protocol.md: ids are unique in flight)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from services.common.errors import AlreadyExists


class InFlightRequests:
    """Used only on the event loop, so a plain set is enough."""

    def __init__(self) -> None:
        self._ids: set[str] = set()

    @contextlib.contextmanager
    def reserve(self, request_id: str) -> Iterator[None]:
        if request_id in self._ids:
            raise AlreadyExists(f"request_id: {request_id!r} is already in flight", field="request_id")
        self._ids.add(request_id)
        try:
            yield
        finally:
            self._ids.discard(request_id)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids
