"""Red-team reproduction: concurrent rolls of one key (CONTRACT section 3).

"A roll never leaves two live successors of one key, and a key's credits are one balance."
`KeyManager.roll` reads the key, checks that it may be rolled, issues the successor, then
sets the old key's `replaced_by` without a condition: rolls that overlap all pass the check,
so each leaves a live successor, and each successor gets the old key's credits. The settings
page calls the same `roll`, so a workspace user multiplies an operator's credit grant.
"""

from __future__ import annotations

import asyncio

import pytest

from apikeys import KeyManager, store_from_url
from apikeys.errors import InvalidTransition
from apikeys.hashing import Hasher

PEPPER = "qbRhbA6IiMiaArqjfWDbsCTo3JRbjUrJdaAXX1c0ERE"


@pytest.mark.asyncio
async def test_concurrent_rolls_leave_one_live_successor_and_one_balance(
    store_url: str, store_options: dict[str, str]
) -> None:
    async with KeyManager(
        store_from_url(store_url, **store_options), hasher=Hasher(PEPPER)
    ) as manager:
        old = await manager.create(name="trial", workspace="acme", full_access=True, credits=5)
        results = await asyncio.gather(
            *[manager.roll(old.record.id) for _ in range(3)], return_exceptions=True
        )
        rolled = [result for result in results if not isinstance(result, BaseException)]
        refused = [result for result in results if isinstance(result, BaseException)]
        assert all(isinstance(error, InvalidTransition) for error in refused), refused
        live = []
        for result in rolled:
            record = await manager.get(result.record.id)
            if record.status == "active":
                live.append(record)
        assert len(live) == 1, [(r.id, r.credits) for r in live]
        granted = sum(record.credits or 0 for record in live)
        assert granted <= 5, granted
