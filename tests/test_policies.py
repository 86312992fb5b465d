"""Key policies on every store: owner, metadata, IP allowlists and credits (CONTRACT §8)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apikeys import InvalidKeyParameters, InvalidTransition, KeyManager
from apikeys.policies import (
    MAX_METADATA_BYTES,
    Refill,
    check_metadata,
    parse_refill,
    policy_fields,
)
from apikeys.stores import KeyStore

ROOT = Path(__file__).resolve().parent.parent


# Policies `create` refuses before the store is read or written: once each on memory (the
# reference), and all of them on every store, which stays empty.
BAD_POLICIES: list[tuple[dict[str, Any], str]] = [
    ({"metadata": [1, 2]}, "JSON object"),
    ({"metadata": "not json"}, "JSON object"),
    ({"metadata": {"big": "x" * MAX_METADATA_BYTES}}, "at most 4096"),
    ({"metadata": {"nan": float("nan")}}, "JSON values"),
    ({"metadata": {"when": datetime.now(UTC)}}, "JSON values"),
    ({"owner": ""}, "owner"),
    ({"owner": "a\nb"}, "control"),
    ({"allowed_ips": ["10.0.0.1/8"]}, "10.0.0.0/8"),
    ({"allowed_ips": ["not an address"]}, "not an address"),
    ({"credits": -1}, "credits"),
    ({"credits": True}, "whole number"),
    ({"credit_refill": "10/hour"}, "1000/day"),
]


class TestRecordFields:
    async def test_policies_are_kept_returned_and_listed(self, manager: KeyManager) -> None:
        created = await manager.create(
            name="Partner",
            workspace="acme",
            full_access=True,
            owner="user_42",
            metadata={"plan": "pro", "seats": 3, "tags": ["a", "ü"]},
            allowed_ips=["10.0.0.0/8", "2001:db8::/32", "192.0.2.7"],
            credits=1000,
        )
        for record in (
            created.record,
            await manager.get(created.record.id),
            (await manager.list("acme"))[0],
        ):
            assert record.owner == "user_42"
            assert record.metadata == {"plan": "pro", "seats": 3, "tags": ["a", "ü"]}
            assert record.allowed_ips == ("10.0.0.0/8", "2001:db8::/32", "192.0.2.7/32")
            assert record.credits == 1000
            assert record.credit_refill is None
        data = (await manager.get(created.record.id)).to_dict()
        assert data["owner"] == "user_42"
        assert data["metadata"]["plan"] == "pro"
        assert data["allowed_ips"] == ["10.0.0.0/8", "2001:db8::/32", "192.0.2.7/32"]
        assert data["credits"] == 1000
        json.dumps(data)

    async def test_a_key_without_policies_has_none(self, manager: KeyManager) -> None:
        record = (await manager.create(name="plain", scopes=["contacts:read"])).record
        stored = await manager.get(record.id)
        assert (stored.owner, stored.metadata, stored.allowed_ips, stored.credits) == (
            None,
            {},
            (),
            None,
        )

    async def test_policies_are_edited_and_cleared(self, manager: KeyManager) -> None:
        key_id = (
            await manager.create(
                name="n", full_access=True, owner="a", metadata={"x": 1}, allowed_ips=["::1"]
            )
        ).record.id
        edited = await manager.update(
            key_id, owner="b", metadata={"y": [1, 2]}, allowed_ips=["203.0.113.0/24"], credits=5
        )
        assert (edited.owner, edited.metadata, edited.allowed_ips, edited.credits) == (
            "b",
            {"y": [1, 2]},
            ("203.0.113.0/24",),
            5,
        )
        assert (await manager.get(key_id)).metadata == {"y": [1, 2]}
        cleared = await manager.update(
            key_id, owner=None, metadata=None, allowed_ips=None, credits=None
        )
        assert (cleared.owner, cleared.metadata, cleared.allowed_ips, cleared.credits) == (
            None,
            {},
            (),
            None,
        )
        assert (await manager.get(key_id)).allowed_ips == ()

    async def test_a_revoked_key_cannot_be_edited(self, manager: KeyManager) -> None:
        key_id = (await manager.create(name="n", full_access=True)).record.id
        await manager.revoke(key_id)
        with pytest.raises(InvalidTransition):
            await manager.update(key_id, credits=10)
        assert (await manager.get(key_id)).credits is None

    async def test_a_rolled_key_keeps_its_policies(self, manager: KeyManager) -> None:
        old = await manager.create(
            name="n", full_access=True, owner="o", metadata={"k": "v"}, allowed_ips=["::1"]
        )
        new = (await manager.roll(old.record.id)).record
        assert (new.owner, new.metadata, new.allowed_ips) == ("o", {"k": "v"}, ("::1/128",))

    @pytest.mark.parametrize(("fields", "message"), BAD_POLICIES)
    async def test_bad_policies_are_refused_and_nothing_is_created(
        self, memory_manager: KeyManager, fields: dict[str, Any], message: str
    ) -> None:
        with pytest.raises(InvalidKeyParameters, match=message):
            await memory_manager.create(name="bad", workspace="refused", full_access=True, **fields)
        assert await memory_manager.list() == []

    async def test_bad_policies_leave_every_store_empty(self, manager: KeyManager) -> None:
        for fields, message in BAD_POLICIES:
            with pytest.raises(InvalidKeyParameters, match=message):
                await manager.create(name="bad", workspace="refused", full_access=True, **fields)
        assert await manager.list() == []


class TestCredits:
    async def test_credits_are_spent_to_zero_and_never_below(self, manager: KeyManager) -> None:
        record = (await manager.create(name="n", full_access=True, credits=3)).record
        spent = [await manager.spend_credits(record) for _ in range(5)]
        assert spent == [2, 1, 0, None, None]
        assert (await manager.get(record.id)).credits == 0

    async def test_a_cost_takes_that_many_or_none(self, manager: KeyManager) -> None:
        record = (await manager.create(name="n", full_access=True, credits=5)).record
        assert await manager.spend_credits(record, 3) == 2
        assert await manager.spend_credits(record, 3) is None  # 2 left: nothing taken
        assert await manager.spend_credits(record, 2) == 0

    async def test_concurrent_spends_take_exactly_the_credits(self, manager: KeyManager) -> None:
        record = (await manager.create(name="n", full_access=True, credits=40)).record
        results = await asyncio.gather(*(manager.spend_credits(record) for _ in range(100)))
        assert sum(result is not None for result in results) == 40
        assert sorted(r for r in results if r is not None) == list(range(40))
        assert (await manager.get(record.id)).credits == 0

    async def test_every_read_and_write_after_a_spend_sees_what_is_left(
        self, manager: KeyManager, store: KeyStore
    ) -> None:
        record = (await manager.create(name="n", full_access=True, credits=10)).record
        assert await manager.spend_credits(record, 3) == 7
        assert (await store.get(record.id)).record.credits == 7  # type: ignore[union-attr]
        assert await manager.spend_credits(record, 2) == 5
        assert [listed.credits for listed in await store.list(record.workspace)] == [5]
        assert await manager.spend_credits(record) == 4
        # A write of another field keeps what is left; a write of the credits replaces it.
        assert (await store.update(record.id, {"name": "renamed"})).credits == 4
        assert await manager.spend_credits(record) == 3
        assert (await store.update(record.id, {"credits": 20})).credits == 20
        assert await manager.spend_credits(record) == 19
        assert (await store.update(record.id, {"credits": None})).credits is None
        assert await manager.spend_credits(record) is None
        assert (await manager.get(record.id)).credits is None

    async def test_the_verification_read_is_the_key_whatever_was_spent(
        self, manager: KeyManager, store: KeyStore
    ) -> None:
        created = await manager.create(name="n", full_access=True, credits=10)
        await manager.spend_credits(created.record, 4)
        verifying = await store.get_for_verification(created.record.id)
        read = await store.get(created.record.id)
        assert read is not None
        assert verifying is not None
        assert verifying.secret_hash == read.secret_hash
        # Only the count may lag there: spending reads it in its own atomic step.
        assert replace(verifying.record, credits=6) == read.record
        assert await store.get_for_verification("0" * 12) is None

    async def test_a_revoked_key_spends_nothing(self, manager: KeyManager) -> None:
        record = (await manager.create(name="n", full_access=True, credits=3)).record
        await manager.revoke(record.id)
        assert await manager.spend_credits(record) is None

    async def test_a_refill_sets_credits_back_at_the_start_of_each_period(
        self, manager: KeyManager, store: KeyStore
    ) -> None:
        record = (await manager.create(name="n", full_access=True, credit_refill="2/day")).record
        assert record.credits == 2  # starts full
        assert [await manager.spend_credits(record) for _ in range(3)] == [1, 0, None]
        # The period ended: the next spend refills first, in the same atomic step.
        yesterday = datetime.now(UTC) - timedelta(days=1)
        await store.update(record.id, {"credits_refilled_at": yesterday})
        assert await manager.spend_credits(record) == 1
        stored = await manager.get(record.id)
        assert stored.credits == 1
        assert stored.credits_refilled_at == Refill(2, "day").period_start(datetime.now(UTC))
        # Too few even after a refill: nothing is taken, but the new period has begun.
        await store.update(record.id, {"credits_refilled_at": yesterday, "credits": 0})
        assert await manager.spend_credits(record, 3) is None
        assert (await manager.get(record.id)).credits == 2


@pytest.mark.parametrize(
    ("now", "day", "month"),
    [
        (datetime(2026, 1, 31, 23, 59, tzinfo=UTC), datetime(2026, 2, 1, tzinfo=UTC), None),
        (datetime(2026, 12, 15, 8, tzinfo=UTC), None, datetime(2027, 1, 1, tzinfo=UTC)),
    ],
)
def test_refill_periods_are_utc_days_and_months(
    now: datetime, day: datetime | None, month: datetime | None
) -> None:
    if day is not None:
        assert Refill(1, "day").next_start(now) == day
    if month is not None:
        assert Refill(1, "month").next_start(now) == month
        assert Refill(1, "month").period_start(now) == datetime(2026, 12, 1, tzinfo=UTC)
    assert parse_refill("1000 per Month") == Refill(1000, "month")
    assert parse_refill("") is None


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=30,
    )
)
def test_metadata_is_accepted_exactly_when_a_small_json_object(value: object) -> None:
    encoded = json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    small = len(encoded.encode()) <= MAX_METADATA_BYTES
    if isinstance(value, dict) and small:
        assert check_metadata(value) == value
    else:
        with pytest.raises(InvalidKeyParameters):
            check_metadata(value)


def test_policy_fields_leave_out_what_was_not_given() -> None:
    assert policy_fields() == {}
    assert policy_fields(credit_refill="5/month") == {"credit_refill": "5/month"}


SPENDER = """
import asyncio, json, sys
from apikeys import store_from_url

async def main() -> None:
    url, options, key_id, tries = sys.argv[1:]
    store = store_from_url(url, **json.loads(options))
    won = 0
    try:
        for _ in range(int(tries)):
            if await store.spend_credits(key_id, 1) is not None:
                won += 1
    finally:
        await store.aclose()
    print(won)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_processes_sharing_a_store_spend_exactly_the_credits(
    manager: KeyManager, store_kind: str, store_url: str, store_options: dict[str, str]
) -> None:
    record = (await manager.create(name="n", full_access=True, credits=150)).record
    if store_kind == "memory":
        # A memory store lives in one process: four concurrent spenders in it instead.
        async def spender() -> int:
            return sum([await manager.spend_credits(record) is not None for _ in range(60)])

        assert sum(await asyncio.gather(*(spender() for _ in range(4)))) == 150
        assert (await manager.get(record.id)).credits == 0
        return
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SPENDER,
            store_url,
            json.dumps(store_options),
            record.id,
            "60",
            cwd=ROOT,
            stdout=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    outputs = [await process.communicate() for process in processes]
    assert all(process.returncode == 0 for process in processes)
    assert sum(int(out.decode()) for out, _ in outputs) == 150  # 240 tries, 150 credits
    assert (await manager.get(record.id)).credits == 0
