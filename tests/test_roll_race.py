"""Rolls of one key sent at once (CONTRACT section 3).

"A roll never leaves two live successors of one key, and a key's credits are one balance."
Rolls that overlap all pass `KeyManager.roll`'s check and each issue a successor; the store
links the old key to the first only, and the others' successors are revoked before they are
shown, so no successor beyond one ever holds the pair's credits. The settings page calls the
same `roll`, so a workspace user cannot multiply an operator's credit grant this way.
"""

from __future__ import annotations

import asyncio

from apikeys import KeyManager, store_from_url
from apikeys.errors import InvalidTransition
from apikeys.hashing import Hasher

PEPPER = "qbRhbA6IiMiaArqjfWDbsCTo3JRbjUrJdaAXX1c0ERE"


async def test_if_rolled_several_times_at_once_then_one_successor_lives_with_the_one_balance(
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
        assert len(rolled) == 1  # one roll wins; the others are refused
        assert (await manager.get(old.record.id)).replaced_by == rolled[0].record.id
        live = []
        for result in rolled:
            record = await manager.get(result.record.id)
            if record.status == "active":
                live.append(record)
        assert len(live) == 1, [(r.id, r.credits) for r in live]
        granted = sum(record.credits or 0 for record in live)
        assert granted <= 5, granted
