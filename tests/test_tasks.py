"""Work a caller stops waiting for fails unseen: no "Task exception was never retrieved"
in the application's logs (`apikeys.tasks`), which a store's channel write or a writer's
wait for acknowledgements left behind by its timer used to print."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from apikeys.tasks import started


async def _fails() -> None:
    await asyncio.sleep(0)
    raise RuntimeError("cannot write the registry: database is locked")


async def _left_behind(start: Any) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        work = start(_fails())
        await asyncio.wait([work])  # it ends; nobody asks for its outcome
        del work
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    return reported


async def test_a_failure_nobody_awaits_is_not_reported_as_never_retrieved() -> None:
    assert await _left_behind(started) == []
    # What asyncio does without it: the failure is logged when the task is collected.
    reported = await _left_behind(asyncio.ensure_future)
    assert [c["message"] for c in reported] == ["Task exception was never retrieved"]


async def test_a_caller_that_still_waits_gets_the_failure() -> None:
    with pytest.raises(RuntimeError, match="locked"):
        await started(_fails())
