"""Fixtures the webhook tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.pgbouncer import free_port
from tests.webhooks.receiver import Receiver


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """A webhook receiver listening on a free local port, stopped when the test ends."""
    started = Receiver(free_port())
    await started.start()
    try:
        yield started
    finally:
        await started.stop()
