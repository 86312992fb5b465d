"""What every `KeyStore` guarantees, checked on each store of the table.

The `store` fixture runs each test on memory, SQLite, PostgreSQL and Redis (a single node, a
local Redis Cluster and a Sentinel set). The memory store is the reference: every other
store must answer exactly as it does.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apikeys.errors import DuplicateKeyId, KeyNotFound
from apikeys.keys import generate_id
from apikeys.listing import KeyFilter, Position, position
from apikeys.stores import KeyStore, MemoryStore
from apikeys.stores.contract import USAGE_BATCH_RETENTION, parse_notice
from apikeys.types import KeyRecord, StoredKey, StoredState, UsageDelta
from tests.conftest import SCALE_OUT_STORES, STORES


@pytest.fixture(params=STORES + SCALE_OUT_STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every store of the table, and the Redis store on a cluster and through Sentinel."""
    return str(request.param)


T0 = datetime(2026, 1, 31, 12, 0, 0, 123456, tzinfo=UTC)
HOUR = timedelta(hours=1)


def new_batch_id() -> str:
    """A fresh usage batch id, as `UsageBuffer` draws one per batch."""
    return uuid.uuid4().hex


def make_key(
    key_id: str | None = None,
    *,
    digest: str = "hash-1",
    **fields: Any,
) -> StoredKey:
    """A key with every field set to something plain; `fields` override any of them."""
    key_id = key_id or generate_id()
    values: dict[str, Any] = {
        "id": key_id,
        "name": f"key {key_id}",
        "workspace": "acme",
        "prefix": f"ak_{key_id}_…",
        "access": "restricted",
        "scopes": ("contacts:read", "contacts:write"),
        "state": "active",
        "rate_limit": "100/minute",
        "created_at": T0,
    }
    values.update(fields)
    return StoredKey(record=KeyRecord(**values), secret_hash=digest)


async def inserted(store: KeyStore, key_id: str | None = None, **fields: Any) -> KeyRecord:
    stored = make_key(key_id, **fields)
    await store.insert(stored)
    return stored.record


async def record_of(store: KeyStore, key_id: str) -> KeyRecord:
    stored = await store.get(key_id)
    assert stored is not None
    return stored.record


def _fields(record: KeyRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in KeyRecord.__dataclass_fields__}


def assert_utc(moment: datetime | None) -> None:
    assert moment is not None
    assert moment.tzinfo is not None
    assert moment.utcoffset() == timedelta(0)


class TestInsertAndGet:
    async def test_if_inserted_then_get_returns_every_field_equal(self, store: KeyStore) -> None:
        stored = make_key(
            name="Zapier's “prod” key ✓",
            workspace="acme-eu",
            access="full",
            scopes=("orders:read", "reports:*"),
            state="revoked",
            rate_limit="10/second",
            created_at=T0,
            expires_at=T0 + timedelta(days=30, microseconds=1),
            last_used_at=T0 + timedelta(seconds=5, microseconds=654321),
            request_count=2**40 + 7,
            revoked_at=T0 + timedelta(days=1, microseconds=999999),
            digest="hmac-sha256$0123456789abcdef",
        )
        await store.insert(stored)

        got = await store.get(stored.record.id)

        assert got == stored
        assert got.secret_hash == stored.secret_hash
        record = got.record
        for moment in (record.created_at, record.expires_at, record.last_used_at):
            assert_utc(moment)
        assert_utc(record.revoked_at)
        assert isinstance(record.scopes, tuple)

    async def test_if_optional_fields_are_empty_then_they_come_back_empty(
        self, store: KeyStore
    ) -> None:
        stored = make_key(scopes=(), rate_limit=None)
        await store.insert(stored)

        got = await store.get(stored.record.id)

        assert got == stored
        assert got.record.scopes == ()
        assert got.record.expires_at is None
        assert got.record.last_used_at is None
        assert got.record.revoked_at is None
        assert got.record.request_count == 0

    async def test_if_datetime_is_in_another_timezone_then_the_same_instant_comes_back(
        self, store: KeyStore
    ) -> None:
        plus_two = timezone(timedelta(hours=2))
        record = await inserted(store, created_at=T0.astimezone(plus_two))

        got = await record_of(store, record.id)

        assert got.created_at == T0
        assert got.created_at.tzinfo is not None

    async def test_if_id_is_unknown_then_get_returns_none(self, store: KeyStore) -> None:
        await inserted(store)

        assert await store.get(generate_id()) is None
        # An id no column holds (PostgreSQL refuses NUL in text) names no key.
        for text in ("a\x00b", "\x00"):
            assert await store.get(text) is None

    async def test_if_id_is_taken_then_insert_raises_duplicate_and_keeps_the_original(
        self, store: KeyStore
    ) -> None:
        original = make_key(digest="first")
        await store.insert(original)

        with pytest.raises(DuplicateKeyId):
            await store.insert(make_key(original.record.id, name="other", digest="second"))

        assert await store.get(original.record.id) == original
        assert len(await store.list()) == 1


class TestList:
    async def test_list_of_a_workspace_is_oldest_first_then_by_id(self, store: KeyStore) -> None:
        ids = sorted(generate_id() for _ in range(4))
        # Inserted out of order; ids[1] and ids[2] share a creation time.
        await inserted(store, ids[2], created_at=T0 + HOUR)
        await inserted(store, ids[3], created_at=T0)
        await inserted(store, ids[1], created_at=T0 + HOUR)
        await inserted(store, ids[0], created_at=T0 + 2 * HOUR)

        records = await store.list("acme")

        assert [record.id for record in records] == [ids[3], ids[1], ids[2], ids[0]]

    async def test_list_of_a_workspace_leaves_out_every_other_workspace(
        self, store: KeyStore
    ) -> None:
        mine = await inserted(store, workspace="acme")
        await inserted(store, workspace="globex")
        await inserted(store, workspace="acme-2")

        assert await store.list("acme") == [mine]

    async def test_list_without_workspace_returns_every_key_oldest_first(
        self, store: KeyStore
    ) -> None:
        newer = await inserted(store, workspace="globex", created_at=T0 + HOUR)
        older = await inserted(store, workspace="acme", created_at=T0)

        assert await store.list() == [older, newer]

    async def test_list_of_an_unknown_workspace_is_empty(self, store: KeyStore) -> None:
        await inserted(store)

        assert await store.list("nobody") == []

    async def test_list_returns_records_with_their_current_state(self, store: KeyStore) -> None:
        record = await inserted(store)
        await store.set_state(record.id, "disabled", allowed_from=("active",), at=T0)
        await store.add_usage({record.id: UsageDelta(3, T0 + HOUR)}, batch_id=new_batch_id())

        [listed] = await store.list("acme")

        assert listed == await record_of(store, record.id)
        assert (listed.state, listed.request_count) == ("disabled", 3)


async def walk(
    store: KeyStore, where: KeyFilter, size: int, now: datetime = T0
) -> list[list[KeyRecord]]:
    """Every page of `where`, `size` at a time, each started after the last one's end."""
    pages: list[list[KeyRecord]] = []
    start: Position | None = None
    while True:
        page = await store.list_page(where, start=start, limit=size, now=now)
        assert len(page) <= size
        if not page:
            return pages
        pages.append(page)
        start = position(page[-1])


# (owner, state, expires_at): every status, for two owners and none.
MIXED = [
    (owner, state, expires_at)
    for owner in ("ann", "bob", None)
    for state, expires_at in (
        ("active", None),
        ("active", T0 + HOUR),  # active at T0
        ("active", T0 - HOUR),  # expired at T0
        ("disabled", T0 - HOUR),  # disabled wins over expired
        ("revoked", None),
    )
]


class TestListPage:
    async def test_pages_follow_the_order_of_list_and_cover_it_once(self, store: KeyStore) -> None:
        ids = sorted(generate_id() for _ in range(7))
        for index, key_id in enumerate(reversed(ids)):
            # Pairs of keys share a creation time: ids break the tie.
            await inserted(store, key_id, created_at=T0 + (index // 2) * HOUR)
        everything = await store.list("acme")

        for size in (1, 2, 3, 7, 8):
            pages = await walk(store, KeyFilter("acme"), size)
            assert [len(page) for page in pages[:-1]] == [size] * (len(pages) - 1)
            assert [record for page in pages for record in page] == everything

    async def test_a_page_starts_after_a_position_even_between_two_keys(
        self, store: KeyStore
    ) -> None:
        first, second, third = sorted(generate_id() for _ in range(3))
        for key_id in (first, second, third):
            await inserted(store, key_id, created_at=T0)
        older = await inserted(store, created_at=T0 - HOUR)
        newer = await inserted(store, created_at=T0 + HOUR)
        where = KeyFilter()

        after_first = await store.list_page(where, start=(T0, first), limit=10, now=T0)
        between = await store.list_page(where, start=(T0, first + "0"), limit=10, now=T0)
        before_all = await store.list_page(where, start=(T0 - 2 * HOUR, ""), limit=2, now=T0)

        assert [r.id for r in after_first] == [second, third, newer.id]
        assert [r.id for r in between] == [second, third, newer.id]
        assert [r.id for r in before_all] == [older.id, first]

    async def test_owner_and_status_keep_what_the_record_says(self, store: KeyStore) -> None:
        for index, (key_owner, state, expires_at) in enumerate(MIXED):
            await inserted(
                store,
                owner=key_owner,
                state=state,
                expires_at=expires_at,
                created_at=T0 - timedelta(days=1, seconds=index),
            )
        await inserted(store, workspace="globex", owner="ann")
        everything = await store.list("acme")

        for owner in ("ann", "nobody", None):
            for status in ("active", "disabled", "revoked", "expired", None):
                where = KeyFilter("acme", owner, status)  # type: ignore[arg-type]
                pages = await walk(store, where, 2)

                expected = [r for r in everything if where.matches(r, T0)]
                assert [record for page in pages for record in page] == expected, where
                per_owner = {"active": 2, None: len(MIXED) // 3}.get(status, 1)
                count = {"ann": per_owner, "nobody": 0, None: 3 * per_owner}[owner]
                assert len(expected) == count, where

    async def test_many_keys_of_one_creation_time_are_neither_repeated_nor_skipped(
        self, store: KeyStore
    ) -> None:
        # More ties than one read of an index takes (Redis reads 64 at a time with a filter).
        ids = sorted(generate_id() for _ in range(150))
        for index, key_id in enumerate(ids):
            await inserted(store, key_id, created_at=T0, owner="ann" if index % 50 == 49 else None)

        for where, size in ((KeyFilter(owner="ann"), 1), (KeyFilter(), 40), (KeyFilter(), 1)):
            pages = await walk(store, where, size)
            listed = [record.id for page in pages for record in page]
            expected = ids[49::50] if where.owner else ids
            assert listed == expected, (where, size)

    async def test_without_a_workspace_every_workspace_is_listed(self, store: KeyStore) -> None:
        mine = await inserted(store, workspace="acme", created_at=T0)
        theirs = await inserted(store, workspace="globex", created_at=T0 + HOUR)

        assert await walk(store, KeyFilter(), 1) == [[mine], [theirs]]
        assert await walk(store, KeyFilter("globex"), 1) == [[theirs]]
        assert await walk(store, KeyFilter("nobody"), 1) == []

    @settings(
        max_examples=15,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data())
    async def test_a_walk_returns_each_key_that_matched_throughout_exactly_once(
        self, store: KeyStore, data: st.DataObject
    ) -> None:
        """Keys created and revoked between pages: what holds (see `apikeys.listing`)."""
        # Each example on keys of its own, with ids that sort as they are made (a draw
        # must not depend on chance: hypothesis replays it).
        workspace = f"w-{uuid.uuid4().hex[:12]}"
        stem = generate_id()[:6]
        made = iter(range(10**6))

        def next_id() -> str:
            return f"{stem}{next(made):06d}"

        owners = st.sampled_from(["ann", "bob", None])
        initial = data.draw(
            st.lists(st.tuples(st.integers(0, 5), owners, st.sampled_from(MIXED)), max_size=14)
        )
        size = data.draw(st.integers(1, 5), label="page size")
        where = KeyFilter(
            workspace,
            data.draw(owners, label="owner"),
            data.draw(st.sampled_from([None, "active", "revoked", "expired"]), label="status"),
        )
        before: dict[str, KeyRecord] = {}
        for minute, owner, (_, state, expires_at) in initial:
            record = await inserted(
                store,
                next_id(),
                workspace=workspace,
                owner=owner,
                state=state,
                expires_at=expires_at,
                created_at=T0 - HOUR + timedelta(minutes=minute),
            )
            before[record.id] = record
        changed: set[str] = set()
        created: dict[str, KeyRecord] = {}
        seen: list[KeyRecord] = []
        start: Position | None = None
        while True:
            page = await store.list_page(where, start=start, limit=size, now=T0)
            assert all(where.matches(record, T0) for record in page)
            seen += page
            if len(page) < size:
                break
            start = position(page[-1])
            # Between pages: revoke a key, or create one (newest, or among the old ones).
            action = data.draw(st.sampled_from(["none", "revoke", "create", "create-old"]))
            if action == "revoke" and before:
                key_id = data.draw(st.sampled_from(sorted(before)))
                changed.add(key_id)
                await store.set_state(key_id, "revoked", allowed_from=("active", "disabled"), at=T0)
            elif action.startswith("create"):
                minute = data.draw(st.integers(0, 5)) if action == "create-old" else 60
                record = await inserted(
                    store,
                    next_id(),
                    workspace=workspace,
                    owner=data.draw(owners),
                    created_at=T0 - HOUR + timedelta(minutes=minute),
                )
                created[record.id] = record

        positions = [position(record) for record in seen]
        assert positions == sorted(set(positions)), "in order, none twice"
        ids = [record.id for record in seen]
        for key_id, record in before.items():
            if key_id not in changed and where.matches(record, T0):
                assert ids.count(key_id) == 1, key_id
        newest = [r for r in created.values() if r.created_at == T0 and where.matches(r, T0)]
        assert all(record.id in ids for record in newest)
        assert set(ids) <= set(before) | set(created)


class TestSetState:
    async def test_if_current_state_is_allowed_then_set_state_changes_it(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)

        after = await store.set_state(record.id, "disabled", allowed_from=("active",), at=T0)

        assert after.state == "disabled"
        assert after.revoked_at is None
        assert await record_of(store, record.id) == after

    async def test_if_revoked_then_revoked_at_is_the_given_time(self, store: KeyStore) -> None:
        record = await inserted(store)
        at = T0 + timedelta(minutes=3, microseconds=42)

        after = await store.set_state(
            record.id, "revoked", allowed_from=("active", "disabled"), at=at
        )

        assert (after.state, after.revoked_at) == ("revoked", at)
        assert_utc(after.revoked_at)
        assert await record_of(store, record.id) == after

    async def test_set_state_changes_nothing_but_state_and_revoked_at(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store, expires_at=T0 + HOUR, request_count=5, last_used_at=T0)

        after = await store.set_state(record.id, "revoked", allowed_from=("active",), at=T0)

        assert after.state == "revoked"
        assert after.revoked_at == T0
        assert KeyRecord(**{**_fields(after), "state": "active", "revoked_at": None}) == record
        stored = await store.get(record.id)
        assert stored is not None
        assert stored.secret_hash == "hash-1"

    async def test_if_current_state_is_not_allowed_then_set_state_leaves_the_key_as_it_is(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store, state="revoked", revoked_at=T0)

        after = await store.set_state(record.id, "active", allowed_from=("disabled",), at=T0 + HOUR)

        assert after == record
        assert await record_of(store, record.id) == record

    async def test_if_already_in_the_state_then_set_state_leaves_the_key_as_it_is(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store, state="revoked", revoked_at=T0)

        after = await store.set_state(
            record.id, "revoked", allowed_from=("active", "disabled", "revoked"), at=T0 + HOUR
        )

        assert after == record
        assert after.revoked_at == T0
        assert await record_of(store, record.id) == record

    async def test_if_enabled_again_then_state_is_active_without_revoked_at(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store, state="disabled")

        after = await store.set_state(record.id, "active", allowed_from=("disabled",), at=T0)

        assert after.state == "active"
        assert after.revoked_at is None

    async def test_if_allowed_from_is_empty_then_set_state_changes_nothing(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)

        after = await store.set_state(record.id, "disabled", allowed_from=(), at=T0)

        assert after == record

    async def test_if_id_is_unknown_then_set_state_raises_key_not_found(
        self, store: KeyStore
    ) -> None:
        await inserted(store)

        with pytest.raises(KeyNotFound):
            await store.set_state(generate_id(), "revoked", allowed_from=("active",), at=T0)

    async def test_if_revoked_concurrently_then_one_revocation_wins_for_everyone(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)
        times = [T0 + timedelta(seconds=i) for i in range(20)]

        results = await asyncio.gather(
            *(
                store.set_state(record.id, "revoked", allowed_from=("active", "disabled"), at=at)
                for at in times
            )
        )

        final = await record_of(store, record.id)
        assert final.state == "revoked"
        assert final.revoked_at in times
        assert {result.revoked_at for result in results} == {final.revoked_at}
        assert {result.state for result in results} == {"revoked"}

    async def test_if_disable_and_revoke_race_then_revoked_is_never_undone(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)
        enable_disable: list[tuple[StoredState, tuple[StoredState, ...]]] = [
            ("disabled", ("active",)),
            ("active", ("disabled",)),
        ] * 10
        revoke: tuple[StoredState, tuple[StoredState, ...]] = ("revoked", ("active", "disabled"))

        await asyncio.gather(
            *(
                store.set_state(record.id, state, allowed_from=allowed, at=T0)
                for state, allowed in [*enable_disable[:7], revoke, *enable_disable[7:]]
            )
        )

        assert (await record_of(store, record.id)).state == "revoked"


class TestShortenExpiry:
    async def test_if_key_has_no_expiry_then_shorten_sets_it(self, store: KeyStore) -> None:
        record = await inserted(store)

        after = await store.shorten_expiry(record.id, T0 + HOUR)

        assert after.expires_at == T0 + HOUR
        assert_utc(after.expires_at)
        assert await record_of(store, record.id) == after

    async def test_if_earlier_then_shorten_moves_the_expiry_earlier(self, store: KeyStore) -> None:
        record = await inserted(store, expires_at=T0 + 2 * HOUR)

        after = await store.shorten_expiry(record.id, T0 + HOUR)

        assert after.expires_at == T0 + HOUR
        assert await record_of(store, record.id) == after

    async def test_if_later_then_shorten_keeps_the_earlier_expiry(self, store: KeyStore) -> None:
        record = await inserted(store, expires_at=T0 + HOUR)

        after = await store.shorten_expiry(record.id, T0 + 2 * HOUR)

        assert after == record
        assert await record_of(store, record.id) == record

    async def test_if_revoked_then_shorten_leaves_the_key_as_it_is(self, store: KeyStore) -> None:
        record = await inserted(store, state="revoked", revoked_at=T0, expires_at=T0 + 2 * HOUR)

        after = await store.shorten_expiry(record.id, T0 + HOUR)

        assert after == record
        assert await record_of(store, record.id) == record

    async def test_if_disabled_then_shorten_still_applies(self, store: KeyStore) -> None:
        record = await inserted(store, state="disabled")

        after = await store.shorten_expiry(record.id, T0 + HOUR)

        assert (after.state, after.expires_at) == ("disabled", T0 + HOUR)

    async def test_if_shortened_concurrently_then_the_earliest_expiry_wins(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store, expires_at=T0 + 100 * HOUR)
        hours = [17, 5, 42, 3, 99, 8, 3, 61, 12, 4]

        await asyncio.gather(*(store.shorten_expiry(record.id, T0 + h * HOUR) for h in hours))

        assert (await record_of(store, record.id)).expires_at == T0 + 3 * HOUR

    async def test_if_id_is_unknown_then_shorten_raises_key_not_found(
        self, store: KeyStore
    ) -> None:
        with pytest.raises(KeyNotFound):
            await store.shorten_expiry(generate_id(), T0)


class TestReplaceHash:
    async def test_if_old_hash_matches_then_replace_hash_swaps_it(self, store: KeyStore) -> None:
        record = await inserted(store, digest="old")

        assert await store.replace_hash(record.id, "old", "new") is True

        stored = await store.get(record.id)
        assert stored is not None
        assert stored.secret_hash == "new"
        assert stored.record == record

    async def test_if_old_hash_differs_then_replace_hash_refuses(self, store: KeyStore) -> None:
        record = await inserted(store, digest="current")

        assert await store.replace_hash(record.id, "stale", "new") is False

        stored = await store.get(record.id)
        assert stored is not None
        assert stored.secret_hash == "current"

    async def test_if_id_is_unknown_then_replace_hash_returns_false(self, store: KeyStore) -> None:
        assert await store.replace_hash(generate_id(), "old", "new") is False

    async def test_if_two_replace_the_same_hash_at_once_then_exactly_one_wins(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store, digest="old")

        results = await asyncio.gather(
            *(store.replace_hash(record.id, "old", f"new-{i}") for i in range(10))
        )

        assert results.count(True) == 1
        stored = await store.get(record.id)
        assert stored is not None
        assert stored.secret_hash == f"new-{results.index(True)}"


class TestAddUsage:
    async def test_add_usage_adds_counts_and_sets_last_used_at(self, store: KeyStore) -> None:
        first = await inserted(store)
        second = await inserted(store, request_count=10, last_used_at=T0)

        await store.add_usage(
            {
                first.id: UsageDelta(3, T0 + HOUR),
                second.id: UsageDelta(2, T0 + 2 * HOUR),
            },
            batch_id=new_batch_id(),
        )

        one, two = await record_of(store, first.id), await record_of(store, second.id)
        assert (one.request_count, one.last_used_at) == (3, T0 + HOUR)
        assert (two.request_count, two.last_used_at) == (12, T0 + 2 * HOUR)
        assert_utc(one.last_used_at)

    async def test_add_usage_never_moves_last_used_at_back(self, store: KeyStore) -> None:
        record = await inserted(store, last_used_at=T0 + HOUR, request_count=1)

        await store.add_usage({record.id: UsageDelta(4, T0)}, batch_id=new_batch_id())

        after = await record_of(store, record.id)
        assert (after.request_count, after.last_used_at) == (5, T0 + HOUR)

    async def test_add_usage_ignores_unknown_ids_and_applies_the_rest(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)
        unknown = generate_id()

        await store.add_usage(
            {unknown: UsageDelta(7, T0), record.id: UsageDelta(1, T0)}, batch_id=new_batch_id()
        )

        assert await store.get(unknown) is None
        assert (await record_of(store, record.id)).request_count == 1
        assert [listed.id for listed in await store.list()] == [record.id]

    async def test_add_usage_with_an_empty_batch_changes_nothing(self, store: KeyStore) -> None:
        record = await inserted(store)

        await store.add_usage({}, batch_id=new_batch_id())

        assert await record_of(store, record.id) == record

    async def test_add_usage_changes_only_count_and_last_used_at(self, store: KeyStore) -> None:
        record = await inserted(store, state="revoked", revoked_at=T0, expires_at=T0 + HOUR)

        await store.add_usage({record.id: UsageDelta(2, T0 + HOUR)}, batch_id=new_batch_id())

        stored = await store.get(record.id)
        assert stored is not None
        assert stored.secret_hash == "hash-1"
        assert stored.record == KeyRecord(
            **{**_fields(record), "request_count": 2, "last_used_at": T0 + HOUR}
        )

    async def test_if_fifty_batches_run_at_once_then_counts_are_exact_and_last_used_is_latest(
        self, store: KeyStore
    ) -> None:
        records = [await inserted(store) for _ in range(5)]
        batches = [
            {
                record.id: UsageDelta(batch + i + 1, T0 + timedelta(seconds=batch * 7 + i))
                for i, record in enumerate(records)
                if (batch + i) % 3 != 0  # not every key in every batch
            }
            for batch in range(50)
        ]

        await asyncio.gather(
            *(store.add_usage(batch, batch_id=new_batch_id()) for batch in batches)
        )

        for record in records:
            deltas = [batch[record.id] for batch in batches if record.id in batch]
            after = await record_of(store, record.id)
            assert after.request_count == sum(delta.count for delta in deltas)
            assert after.last_used_at == max(delta.last_used_at for delta in deltas)

    async def test_counting_requests_is_no_change_a_key_cache_hears_of(
        self, store: KeyStore
    ) -> None:
        # A key cache drops a key on every notice of it, and every process writes its counts
        # each second: were counting a change, no key in use would stay cached.
        channel = store.channel()
        if channel is None:
            pytest.skip("the memory store has no channel: nothing to hear")
        heard: list[str] = []
        channel.bind()
        await channel.connect("reader", lambda notice: heard.append(parse_notice(notice)[1]))
        try:
            record = await inserted(store)
            await channel.probe()  # every committed change has arrived
            heard.clear()
            await store.add_usage({record.id: UsageDelta(3, T0)}, batch_id=new_batch_id())
            await channel.probe()
            assert heard == []
            assert (await record_of(store, record.id)).request_count == 3
            # A change of the key itself is heard, whoever makes it.
            await store.set_state(record.id, "disabled", allowed_from=("active",), at=T0)
            await channel.probe()
            assert record.id in heard
        finally:
            await channel.disconnect()


class TestAddUsageBatchIds:
    """`add_usage` applies each batch id once: a batch sent again (its answer was lost, or
    its sender was cancelled) is skipped, whatever the store."""

    async def test_if_the_same_batch_id_is_sent_twice_then_it_is_counted_once(
        self, store: KeyStore
    ) -> None:
        first, second = await inserted(store), await inserted(store, request_count=10)
        batch = {first.id: UsageDelta(3, T0 + HOUR), second.id: UsageDelta(2, T0)}
        batch_id = new_batch_id()

        await store.add_usage(batch, batch_id=batch_id)
        await store.add_usage(batch, batch_id=batch_id)

        one, two = await record_of(store, first.id), await record_of(store, second.id)
        assert (one.request_count, one.last_used_at) == (3, T0 + HOUR)
        assert (two.request_count, two.last_used_at) == (12, T0)

    async def test_if_a_batch_id_comes_back_with_later_usage_then_nothing_of_it_applies(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)
        batch_id = new_batch_id()
        await store.add_usage({record.id: UsageDelta(1, T0)}, batch_id=batch_id)

        await store.add_usage({record.id: UsageDelta(5, T0 + HOUR)}, batch_id=batch_id)

        after = await record_of(store, record.id)
        assert (after.request_count, after.last_used_at) == (1, T0)

    async def test_if_different_batch_ids_carry_the_same_counts_then_both_count(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)
        batch = {record.id: UsageDelta(4, T0)}

        await store.add_usage(batch, batch_id=new_batch_id())
        await store.add_usage(batch, batch_id=new_batch_id())

        assert (await record_of(store, record.id)).request_count == 8

    async def test_if_one_batch_id_is_sent_many_times_at_once_then_it_is_counted_once(
        self, store: KeyStore
    ) -> None:
        records = [await inserted(store) for _ in range(3)]
        batch = {record.id: UsageDelta(i + 1, T0) for i, record in enumerate(records)}
        batch_id = new_batch_id()

        await asyncio.gather(*(store.add_usage(batch, batch_id=batch_id) for _ in range(10)))

        for i, record in enumerate(records):
            assert (await record_of(store, record.id)).request_count == i + 1

    async def test_if_a_batch_id_was_used_for_unknown_ids_only_then_it_is_still_skipped(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)
        batch_id = new_batch_id()
        await store.add_usage({generate_id(): UsageDelta(2, T0)}, batch_id=batch_id)

        await store.add_usage({record.id: UsageDelta(2, T0)}, batch_id=batch_id)

        if getattr(store, "deployment", None) == "cluster":
            # A cluster remembers a batch per key (no marker can sit in every key's slot):
            # each key's usage of a batch counts once, but a batch id reused for another key
            # counts for it. Batches are never reused so: a batch is resent as it was.
            assert (await record_of(store, record.id)).request_count == 2
            return
        assert (await record_of(store, record.id)).request_count == 0

    async def test_if_batches_and_their_retries_interleave_then_each_counts_once(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)
        batches = [(new_batch_id(), UsageDelta(n + 1, T0 + n * HOUR)) for n in range(20)]

        await asyncio.gather(
            *(
                store.add_usage({record.id: delta}, batch_id=batch_id)
                for batch_id, delta in batches + batches[::-1] + batches[::3]
            )
        )

        after = await record_of(store, record.id)
        assert after.request_count == sum(delta.count for _, delta in batches)
        assert after.last_used_at == T0 + 19 * HOUR


class TestUsageBatchRetention:
    """Each store remembers an applied batch id for `USAGE_BATCH_RETENTION`, then forgets it
    (so what it keeps stays bounded)."""

    async def test_batch_ids_are_kept_for_the_retention_window_then_forgotten(
        self, store: KeyStore
    ) -> None:
        record = await inserted(store)
        old_id = new_batch_id()
        await store.add_usage({record.id: UsageDelta(1, T0)}, batch_id=old_id)
        window = USAGE_BATCH_RETENTION.total_seconds()

        if type(store).__name__ == "RedisStore":
            from apikeys.stores.redis import RedisStore

            assert isinstance(store, RedisStore)
            # The marker expires with the window; Redis forgets it by itself.
            ttl = await store.client.ttl(store.usage_batch_name(old_id, record.id))
            assert window - 60 < ttl <= window
            return
        if isinstance(store, MemoryStore):
            applied = store._applied_batches  # no clock to move otherwise
            applied[old_id] -= window + 1
            pruner: KeyStore = store
        else:
            import sqlalchemy as sa

            from apikeys.stores.sql.store import SQLStore

            assert isinstance(store, SQLStore)
            batches = store.usage_batches
            async with store.engine.begin() as conn:
                [applied_at] = (await conn.execute(sa.select(batches.c.applied_at))).scalars()
                assert abs(applied_at - datetime.now(UTC)) < timedelta(minutes=1)
                await conn.execute(
                    sa.update(batches).values(
                        applied_at=applied_at - USAGE_BATCH_RETENTION - timedelta(seconds=1)
                    )
                )
            # A store prunes on its first batch, then at most once a minute.
            pruner = SQLStore(store.engine, table_name=store.table.name)

        await pruner.add_usage({record.id: UsageDelta(1, T0)}, batch_id=new_batch_id())
        await store.add_usage({record.id: UsageDelta(1, T0)}, batch_id=old_id)

        assert (await record_of(store, record.id)).request_count == 3
        if not isinstance(store, MemoryStore):
            async with store.engine.connect() as conn:
                count = (await conn.execute(sa.select(sa.func.count()).select_from(batches))).one()
            assert count == (2,)


class TestOneTimeValues:
    """`put_once` and `take_once`: a value is taken at most once, everywhere, within its ttl."""

    async def test_a_value_put_is_taken_once_then_gone(self, store: KeyStore) -> None:
        token = uuid.uuid4().hex
        await store.put_once(token, "sealed.value", timedelta(minutes=5))
        assert await store.take_once(token) == "sealed.value"
        assert await store.take_once(token) is None

    async def test_an_unknown_token_takes_nothing(self, store: KeyStore) -> None:
        assert await store.take_once(uuid.uuid4().hex) is None

    async def test_values_under_different_tokens_are_taken_apart(self, store: KeyStore) -> None:
        first, second = uuid.uuid4().hex, uuid.uuid4().hex
        await store.put_once(first, "one", timedelta(minutes=5))
        await store.put_once(second, "two", timedelta(minutes=5))
        assert await store.take_once(second) == "two"
        assert await store.take_once(first) == "one"

    async def test_if_many_take_one_value_at_once_then_exactly_one_gets_it(
        self, store: KeyStore
    ) -> None:
        token = uuid.uuid4().hex
        await store.put_once(token, "once", timedelta(minutes=5))
        taken = await asyncio.gather(*(store.take_once(token) for _ in range(20)))
        assert taken.count("once") == 1
        assert taken.count(None) == 19

    async def test_if_its_ttl_has_passed_then_a_value_is_never_taken(self, store: KeyStore) -> None:
        at_once, soon = uuid.uuid4().hex, uuid.uuid4().hex
        await store.put_once(at_once, "expired", timedelta(0))
        await store.put_once(soon, "expires", timedelta(milliseconds=50))
        await asyncio.sleep(0.5)
        assert await store.take_once(at_once) is None
        assert await store.take_once(soon) is None

    def test_every_store_keeps_one_time_values(self, store: KeyStore) -> None:
        assert store.keeps_one_time_values()

    async def test_a_value_put_again_replaces_the_first(self, store: KeyStore) -> None:
        token = uuid.uuid4().hex
        await store.put_once(token, "first", timedelta(minutes=5))
        await store.put_once(token, "second", timedelta(minutes=5))
        assert await store.take_once(token) == "second"
        assert await store.take_once(token) is None


async def expired(store: KeyStore, token: str) -> None:
    """Return once the value under `token` has expired (within 10 s)."""
    for _ in range(1000):
        if await store.peek_once(token) is None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the value outlived its ttl")


class TestOneTimeValuesInPlace:
    """`peek_once`, `put_once_if_absent`, `replace_once`: a value read without being taken,
    put only where none lives, replaced only where it is the one expected; each one step."""

    def test_every_store_compares_one_time_values(self, store: KeyStore) -> None:
        assert store.compares_one_time_values()

    async def test_a_peek_leaves_the_value_where_it_is(self, store: KeyStore) -> None:
        token = uuid.uuid4().hex
        assert await store.peek_once(token) is None
        await store.put_once(token, "kept", timedelta(minutes=5))
        assert await store.peek_once(token) == "kept"
        assert await store.peek_once(token) == "kept"
        assert await store.take_once(token) == "kept"
        assert await store.peek_once(token) is None

    async def test_a_value_is_put_if_absent_only_where_none_lives(self, store: KeyStore) -> None:
        token = uuid.uuid4().hex
        assert await store.put_once_if_absent(token, "first", timedelta(minutes=5))
        assert not await store.put_once_if_absent(token, "second", timedelta(minutes=5))
        assert await store.peek_once(token) == "first"
        assert await store.take_once(token) == "first"
        assert await store.put_once_if_absent(token, "third", timedelta(minutes=5))
        assert await store.take_once(token) == "third"

    async def test_if_many_put_one_token_if_absent_at_once_then_exactly_one_wins(
        self, store: KeyStore
    ) -> None:
        token = uuid.uuid4().hex
        won = await asyncio.gather(
            *(store.put_once_if_absent(token, f"v{n}", timedelta(minutes=5)) for n in range(20))
        )
        assert won.count(True) == 1
        assert await store.take_once(token) == f"v{won.index(True)}"

    async def test_an_expired_value_blocks_no_new_one_and_is_never_replaced(
        self, store: KeyStore
    ) -> None:
        token = uuid.uuid4().hex
        await store.put_once(token, "old", timedelta(milliseconds=20))
        await expired(store, token)
        assert not await store.replace_once(token, "old", "new", timedelta(minutes=5))
        assert not await store.replace_once(token, "old", None, timedelta(minutes=5))
        assert await store.put_once_if_absent(token, "new", timedelta(minutes=5))
        assert await store.peek_once(token) == "new"
        assert await store.take_once(token) == "new"

    async def test_a_value_is_replaced_or_removed_only_where_it_is_the_one_expected(
        self, store: KeyStore
    ) -> None:
        token = uuid.uuid4().hex
        assert not await store.replace_once(token, "a", "b", timedelta(minutes=5))
        assert await store.peek_once(token) is None  # nothing was put
        await store.put_once(token, "a", timedelta(minutes=5))
        assert not await store.replace_once(token, "other", "b", timedelta(minutes=5))
        assert not await store.replace_once(token, "other", None, timedelta(minutes=5))
        assert await store.peek_once(token) == "a"
        assert await store.replace_once(token, "a", "b", timedelta(minutes=5))
        assert not await store.replace_once(token, "a", "c", timedelta(minutes=5))
        assert await store.peek_once(token) == "b"
        assert await store.replace_once(token, "b", None, timedelta(minutes=5))
        assert await store.peek_once(token) is None
        assert not await store.replace_once(token, "b", None, timedelta(minutes=5))

    async def test_a_replacing_value_lives_for_its_own_ttl(self, store: KeyStore) -> None:
        token = uuid.uuid4().hex
        await store.put_once(token, "a", timedelta(minutes=5))
        assert await store.replace_once(token, "a", "b", timedelta(milliseconds=20))
        await expired(store, token)
        assert await store.take_once(token) is None

    async def test_if_many_replace_one_value_at_once_then_exactly_one_does(
        self, store: KeyStore
    ) -> None:
        token = uuid.uuid4().hex
        await store.put_once(token, "a", timedelta(minutes=5))
        replaced = await asyncio.gather(
            *(store.replace_once(token, "a", f"v{n}", timedelta(minutes=5)) for n in range(20))
        )
        assert replaced.count(True) == 1
        assert await store.take_once(token) == f"v{replaced.index(True)}"


class TestRolledPairSharesOneBalance:
    """CONTRACT §3: a rolled pair in its grace period spends one balance, never a copy."""

    @staticmethod
    def manager(store: KeyStore) -> Any:
        from apikeys import Hasher, KeyManager

        return KeyManager(
            store, hasher=Hasher(pepper="wrjGLhRTRwEQT353KSMSHXoF1OGkYZRHIxeUus2WdkY")
        )

    async def test_a_roll_moves_the_balance_and_both_keys_spend_it(self, store: KeyStore) -> None:
        async with self.manager(store) as manager:
            old = await manager.create(name="n", scopes=["contacts:read"], credits=100)
            for _ in range(40):
                assert await manager.spend_credits(old.record, 1) is not None
            new = await manager.roll(old.record.id, grace=timedelta(hours=24))
            assert new.record.credits == 60

            admitted = 0
            for _ in range(100):  # both keys, in turn, until the balance is spent
                for record in (old.record, new.record):
                    if await manager.spend_credits(record, 1) is not None:
                        admitted += 1
            assert admitted == 60  # not 120: one balance for the pair
            assert (await manager.get(old.record.id)).credits == 0
            assert (await manager.get(new.record.id)).credits == 0
            listed = {record.id: record.credits for record in await manager.list()}
            assert listed == {old.record.id: 0, new.record.id: 0}

    async def test_concurrent_spends_on_both_keys_never_exceed_the_balance(
        self, store: KeyStore
    ) -> None:
        async with self.manager(store) as manager:
            old = await manager.create(name="n", scopes=["contacts:read"], credits=50)
            new = await manager.roll(old.record.id, grace=timedelta(hours=1))
            newer = await manager.roll(new.record.id, grace=timedelta(hours=1))

            async def spend(record: KeyRecord) -> list[int]:
                left = []
                for _ in range(15):
                    spent = await manager.spend_credits(record, 1)
                    if spent is not None:
                        left.append(spent)
                return left

            records = [old.record, new.record, newer.record] * 2
            results = await asyncio.gather(*(spend(record) for record in records))
            left = sorted(value for result in results for value in result)
            assert left == list(range(50))  # each credit spent once, by whichever key
            for record in records[:3]:
                assert (await manager.get(record.id)).credits == 0

    async def test_spends_that_race_the_roll_are_taken_once(self, store: KeyStore) -> None:
        async with self.manager(store) as manager:
            old = await manager.create(name="n", scopes=["contacts:read"], credits=40)
            rolled = asyncio.Event()

            async def spend_until_rolled() -> int:
                admitted = 0
                while not rolled.is_set():
                    admitted += await manager.spend_credits(old.record, 1) is not None
                    await asyncio.sleep(0)
                return admitted

            async def roll() -> Any:
                await asyncio.sleep(0)
                try:
                    return await manager.roll(old.record.id, grace=timedelta(hours=1))
                finally:
                    rolled.set()

            *during, new = await asyncio.gather(*(spend_until_rolled() for _ in range(4)), roll())
            # Moved: what the old key had not spent when linked (some spent since, maybe).
            assert new.record.credits >= 40 - sum(during)
            after = 0
            for _ in range(40):
                for record in (old.record, new.record):
                    after += await manager.spend_credits(record, 1) is not None
            assert sum(during) + after == 40

    async def test_revoking_either_key_gives_the_other_no_credits(self, store: KeyStore) -> None:
        async with self.manager(store) as manager:
            old = await manager.create(name="n", scopes=["contacts:read"], credits=10)
            new = await manager.roll(old.record.id, grace=timedelta(hours=1))
            assert await manager.spend_credits(old.record, 3) == 7
            await manager.revoke(old.record.id)
            assert await manager.spend_credits(old.record, 1) is None
            assert await manager.spend_credits(new.record, 2) == 5

            other = await manager.create(name="m", scopes=["contacts:read"], credits=10)
            successor = await manager.roll(other.record.id, grace=timedelta(hours=1))
            await manager.revoke(successor.record.id)
            # The old key still spends the pair's balance, and only that.
            assert await manager.spend_credits(other.record, 4) == 6
            assert await manager.spend_credits(successor.record, 1) is None
            assert (await manager.get(other.record.id)).credits == 6

    async def test_a_refill_applies_once_to_the_pair(self, store: KeyStore) -> None:
        async with self.manager(store) as manager:
            old = await manager.create(name="n", scopes=["contacts:read"], credit_refill="5/day")
            assert await manager.spend_credits(old.record, 5) == 0
            new = await manager.roll(old.record.id, grace=timedelta(hours=1))
            assert new.record.credits == 0
            # The next day's refill, due for the pair: taken by whichever key spends first.
            yesterday = new.record.credits_refilled_at - timedelta(days=1)  # type: ignore[operator]
            await store.update(new.record.id, {"credits_refilled_at": yesterday})
            assert await manager.spend_credits(old.record, 1) == 4
            assert await manager.spend_credits(new.record, 1) == 3
            assert await manager.spend_credits(old.record, 3) == 0
            assert await manager.spend_credits(new.record, 1) is None

    async def test_the_credits_of_a_rolled_key_are_changed_on_its_successor(
        self, store: KeyStore
    ) -> None:
        from apikeys import InvalidTransition

        async with self.manager(store) as manager:
            old = await manager.create(name="n", scopes=["contacts:read"], credits=10)
            new = await manager.roll(old.record.id, grace=timedelta(hours=1))
            with pytest.raises(InvalidTransition, match=new.record.id):
                await manager.update(old.record.id, credits=1000)
            await manager.update(new.record.id, credits=3)
            assert (await manager.get(old.record.id)).credits == 3
            assert await manager.spend_credits(old.record, 3) == 0
            # A new refill on the successor is the pair's: the old key refills by it too.
            await manager.update(new.record.id, credit_refill="7/day")
            assert (await manager.get(old.record.id)).credit_refill == "7/day"

    async def test_a_rolled_key_edited_shows_the_balance_it_spends_from(
        self, store: KeyStore
    ) -> None:
        # Its successor's balance changed without the manager (a plain store write): the
        # old key's own count is stale, and an edit of the old key shows what `get` shows.
        async with self.manager(store) as manager:
            old = await manager.create(name="n", scopes=["contacts:read"], credits=0)
            new = await manager.roll(old.record.id, grace=timedelta(hours=1))
            await store.update(new.record.id, {"credits": 1})
            edited = await manager.update(old.record.id, name="renamed", credits=1)
            assert edited.credits == 1 == (await manager.get(old.record.id)).credits

    async def test_a_spend_follows_the_link_a_roll_sets(self, store: KeyStore) -> None:
        old = await inserted(store, credits=9)
        new = await inserted(store, credits=0, replaces=old.id)
        assert await store.spend_credits(old.id, 2) == 7
        linked = await store.shorten_expiry(old.id, T0 + HOUR, replaced_by=new.id)
        assert linked.credits == 7
        assert await store.spend_credits(old.id, 1) is None  # the successor holds none yet
        await store.update(new.id, {"credits": linked.credits})
        assert await store.spend_credits(old.id, 1) == 6
        assert await store.spend_credits(new.id, 6) == 0
        assert (await record_of(store, old.id)).credits == 7  # its own count is left alone
        await store.set_state(new.id, "revoked", allowed_from=("active",), at=T0)
        await store.update(new.id, {"credits": 5})  # a revoked key is not changed
        assert await store.spend_credits(old.id, 1) is None
