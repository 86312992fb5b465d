"""Work an await may stop waiting for while it runs on: its outcome marked as seen.

A store's statement runs to its end when its caller gives up (a probe past its time, a
writer whose wait ran out), and a writer's wait for acknowledgements may be left behind by
its timer. If such work then fails, nobody awaits it, and asyncio would log "Task exception
was never retrieved" with the exception's text at its garbage collection: noise at best,
a store's message in the application's logs at worst. `settled` marks the outcome seen;
the caller that still waits gets it all the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["settled", "started"]

_T = TypeVar("_T")


def settled(future: asyncio.Future[Any]) -> None:
    """A done callback marking `future`'s exception (if any) as retrieved."""
    if not future.cancelled():
        future.exception()


def started(work: Awaitable[_T]) -> asyncio.Future[_T]:
    """`work` as a task (or future) of its own, its outcome marked as seen when it ends."""
    future = asyncio.ensure_future(work)
    future.add_done_callback(settled)
    return future
