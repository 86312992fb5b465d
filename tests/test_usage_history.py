"""Usage history on every store: requests per key, UTC day and outcome (CONTRACT §9)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from apikeys import KeyManager
from apikeys.stores import KeyStore
from apikeys.types import DailyUsage, UsageDelta

TODAY = datetime.now(UTC).date()
YESTERDAY = TODAY - timedelta(days=1)


async def test_batches_add_to_the_daily_counts_exactly_once(
    manager: KeyManager, store: KeyStore
) -> None:
    key_id = (await manager.create(name="n", full_access=True)).record.id
    now = datetime.now(UTC)
    batch = {
        key_id: UsageDelta(
            5,
            now,
            {
                (YESTERDAY.isoformat(), "admitted"): 2,
                (TODAY.isoformat(), "admitted"): 1,
                (TODAY.isoformat(), "rate_limited"): 2,
            },
        )
    }
    await store.add_usage(batch, batch_id="b1")
    await store.add_usage(batch, batch_id="b1")  # sent again: applied once
    await store.add_usage(
        {key_id: UsageDelta(1, now, {(TODAY.isoformat(), "admitted"): 1})}, batch_id="b2"
    )
    history = await store.usage_history(key_id, YESTERDAY)
    assert history == [
        DailyUsage(YESTERDAY, admitted=2),
        DailyUsage(TODAY, admitted=2, refused={"rate_limited": 2}),
    ]
    assert await store.usage_history(key_id, TODAY + timedelta(days=1)) == []
    assert (await manager.get(key_id)).request_count == 6


async def test_an_unknown_key_gets_no_history(store: KeyStore) -> None:
    await store.add_usage(
        {"AAAAAAAAAAAA": UsageDelta(1, datetime.now(UTC), {(TODAY.isoformat(), "admitted"): 1})},
        batch_id="b3",
    )
    assert await store.usage_history("AAAAAAAAAAAA", date(2000, 1, 1)) == []


def test_daily_usage_to_dict() -> None:
    usage = DailyUsage(date(2026, 3, 1), admitted=3, refused={"insufficient_scope": 1})
    assert usage.total == 4
    assert usage.to_dict() == {
        "day": "2026-03-01",
        "admitted": 3,
        "refused": {"insufficient_scope": 1},
    }
