"""services/common/log.request_context: the request id tags log lines inside the block and
is restored after it; an async generator holding the block that is closed from another
task (a cancelled streaming RPC's generator, finalized by the loop) ends quietly."""

from __future__ import annotations

import asyncio

from services.common.log import request_context, request_id_var


def test_sets_and_restores():
    before = request_id_var.get()
    with request_context("r-1"):
        assert request_id_var.get() == "r-1"
        with request_context(""):
            assert request_id_var.get() == "-"
        assert request_id_var.get() == "r-1"
    assert request_id_var.get() == before


def test_async_generator_closed_from_another_task():
    async def stream():
        with request_context("r-2"):
            while True:
                yield request_id_var.get()

    async def main():
        gen = stream()
        seen = await asyncio.create_task(gen.__anext__())  # the block opens in one task's context
        await asyncio.create_task(gen.aclose())  # ... and ends in another's (GeneratorExit there)
        return seen

    assert asyncio.run(main()) == "r-2"
