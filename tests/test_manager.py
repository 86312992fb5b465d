"""KeyManager behaviour, run on every store of the table (memory, SQLite, PostgreSQL, Redis)."""

from __future__ import annotations

import asyncio
import gc
import re
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from apikeys import (
    APIKeyMiddleware,
    InvalidAPIKey,
    InvalidKeyParameters,
    InvalidTransition,
    KeyDisabled,
    KeyExpired,
    KeyManager,
    KeyNotFound,
    KeyRecord,
    KeyRevoked,
    MalformedAPIKey,
    MemoryStore,
    store_from_url,
)
from apikeys.errors import ConfigurationError, StoreUnavailable
from apikeys.hashing import Hasher
from apikeys.keys import environments_of, generate_key, parse_key
from apikeys.stores import KeyStore
from apikeys.stores.sql.store import SQLStore
from apikeys.types import isoformat
from tests.conftest import TEST_PEPPER

KEY_RE = re.compile(r"^ak_live_[0-9A-Za-z]{12}_[0-9A-Za-z]{32}[0-9A-Za-z]{6}$")
ISO_Z = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


def wrong_secret(token: str) -> str:
    """The same id and prefix with another secret and a valid checksum."""
    parsed = parse_key(token)
    secret = ("A" if parsed.secret[0] != "A" else "B") + parsed.secret[1:]
    return type(parsed)(parsed.prefix, parsed.id, secret).token


# Arguments `create` refuses before the store is read or written. Each case runs once, on
# memory (the reference); on every store one test runs them all and finds the store empty.
BAD_CREATE: list[tuple[dict[str, object], str]] = [
    ({"scopes": []}, "at least one scope"),
    ({"scopes": ["contacts"]}, "invalid scope"),
    ({"scopes": ["Contacts:Read"]}, "invalid scope"),
    ({"full_access": True, "scopes": ["contacts:read"]}, "takes no scopes"),
    ({"scopes": ["contacts:read"], "rate_limit": "lots"}, "invalid rate limit"),
    ({"scopes": ["contacts:read"], "expires_in": timedelta(seconds=-1)}, "positive"),
    ({"scopes": ["contacts:read"], "expires_in": timedelta(days=999_999_999)}, "year 9999"),
    (
        {"scopes": ["contacts:read"], "expires_at": datetime(2000, 1, 1, tzinfo=UTC)},
        "future",
    ),
    ({"scopes": ["contacts:read"], "expires_at": datetime(2999, 1, 1)}, "timezone"),
    ({"scopes": ["contacts:read"], "name": ""}, "name"),
    ({"scopes": ["contacts:read"], "name": "x" * 201}, "name"),
    ({"scopes": ["contacts:read"], "name": "a\nb"}, "name"),
    ({"scopes": ["contacts:read"], "workspace": ""}, "workspace"),
]


class TestCreate:
    async def test_if_created_then_key_is_shown_once_in_contract_format(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(name="Zapier", workspace="acme", scopes=["contacts:read"])
        assert KEY_RE.match(created.key)
        record = created.record
        assert created.key.startswith(f"ak_live_{record.id}_")
        assert record.prefix == f"ak_live_{record.id}_…"
        assert (record.name, record.workspace, record.access) == ("Zapier", "acme", "restricted")
        assert record.scopes == ("contacts:read",)
        assert record.status == "active"
        assert record.request_count == 0
        assert record.last_used_at is None
        assert record.created_at.tzinfo is not None
        secret = parse_key(created.key).secret
        assert secret not in repr(created)
        assert secret not in repr(record)
        assert secret not in str(record.to_dict())

    async def test_if_record_read_back_then_it_holds_no_secret_and_contract_fields(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(
            name="ops", workspace="acme", full_access=True, rate_limit="10/second"
        )
        data = (await manager.get(created.record.id)).to_dict()
        assert list(data) == [
            "id",
            "name",
            "workspace",
            "prefix",
            "access",
            "scopes",
            "status",
            "rate_limit",
            "rate_limits",
            "created_at",
            "expires_at",
            "last_used_at",
            "request_count",
            "revoked_at",
            "replaces",
            "replaced_by",
            "owner",
            "metadata",
            "allowed_ips",
            "credits",
            "credit_refill",
            "imported_prefix",
            "environment",
            "identity",
        ]
        assert data["access"] == "full"
        assert data["environment"] == "live"
        assert data["rate_limit"] == "10/second"
        assert ISO_Z.match(data["created_at"])
        assert parse_key(created.key).secret not in str(data)
        assert created.to_dict()["key"] == created.key

    @pytest.mark.parametrize(("kwargs", "message"), BAD_CREATE)
    async def test_if_parameters_bad_then_refused_and_nothing_stored(
        self, memory_manager: KeyManager, kwargs: dict[str, object], message: str
    ) -> None:
        arguments: dict[str, object] = {"name": "n", "workspace": "w", **kwargs}
        with pytest.raises(InvalidKeyParameters, match=message):
            await memory_manager.create(**arguments)  # type: ignore[arg-type]
        assert await memory_manager.list() == []

    async def test_if_parameters_bad_then_every_store_stays_empty(
        self, manager: KeyManager
    ) -> None:
        for kwargs, message in BAD_CREATE:
            arguments: dict[str, object] = {"name": "n", "workspace": "w", **kwargs}
            with pytest.raises(InvalidKeyParameters, match=message):
                await manager.create(**arguments)  # type: ignore[arg-type]
        assert await manager.list() == []

    async def test_if_listed_then_only_that_workspace_oldest_first(
        self, manager: KeyManager
    ) -> None:
        first = await manager.create(name="a", workspace="acme", scopes=["contacts:read"])
        await manager.create(name="b", workspace="globex", scopes=["contacts:read"])
        third = await manager.create(name="c", workspace="acme", full_access=True)
        listed = await manager.list("acme")
        assert [record.id for record in listed] == [first.record.id, third.record.id]
        assert await manager.list("nobody") == []


class TestVerify:
    async def test_if_key_valid_then_verify_returns_its_record(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        record = await manager.verify(created.key)
        assert record.id == created.record.id

    async def test_if_secret_wrong_then_invalid(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        with pytest.raises(InvalidAPIKey):
            await manager.verify(wrong_secret(created.key))

    async def test_if_id_unknown_then_invalid(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        parsed = parse_key(created.key)
        unknown = type(parsed)(parsed.prefix, "Z" * 12, parsed.secret).token
        with pytest.raises(InvalidAPIKey):
            await manager.verify(unknown)

    async def test_if_garbage_then_malformed(self, manager: KeyManager) -> None:
        with pytest.raises(MalformedAPIKey):
            await manager.verify("not a key")

    async def test_if_prefix_differs_from_managers_then_malformed(
        self, store: KeyStore, hasher: Hasher
    ) -> None:
        async with (
            KeyManager(store, hasher=hasher, prefix="sk_live") as issuing,
            KeyManager(store, hasher=hasher) as other,
        ):
            created = await issuing.create(name="n", workspace="w", scopes=["contacts:read"])
            assert created.key.startswith("sk_live_")
            assert (await issuing.verify(created.key)).id == created.record.id
            with pytest.raises(MalformedAPIKey):
                await other.verify(created.key)

    async def test_if_secret_wrong_for_revoked_key_then_invalid_not_revoked(
        self, manager: KeyManager
    ) -> None:
        # A wrong secret learns nothing about the key's state.
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.revoke(created.record.id)
        with pytest.raises(InvalidAPIKey):
            await manager.verify(wrong_secret(created.key))


class TestTransitions:
    async def test_if_disabled_then_refused_until_enabled(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        key_id = created.record.id
        assert (await manager.disable(key_id)).status == "disabled"
        with pytest.raises(KeyDisabled):
            await manager.verify(created.key)
        assert (await manager.disable(key_id)).status == "disabled"  # idempotent
        assert (await manager.enable(key_id)).status == "active"
        await manager.verify(created.key)

    async def test_if_revoked_then_next_verify_is_refused(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.verify(created.key)
        record = await manager.revoke(created.record.id)
        assert record.status == "revoked"
        assert record.revoked_at is not None
        with pytest.raises(KeyRevoked):
            await manager.verify(created.key)

    async def test_if_revoked_then_it_stays_listed_for_audit(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.revoke(created.record.id)
        [listed] = await manager.list("w")
        assert listed.status == "revoked"

    async def test_if_disabled_key_revoked_then_revoked(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.disable(created.record.id)
        assert (await manager.revoke(created.record.id)).status == "revoked"

    @pytest.mark.parametrize("action", ["enable", "disable", "roll"])
    async def test_if_revoked_then_revival_is_refused(
        self, manager: KeyManager, action: str
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        first = await manager.revoke(created.record.id)
        with pytest.raises(InvalidTransition, match="revoked"):
            await getattr(manager, action)(created.record.id)
        again = await manager.revoke(created.record.id)  # idempotent, keeps the first time
        assert again.revoked_at == first.revoked_at
        with pytest.raises(KeyRevoked):
            await manager.verify(created.key)

    @pytest.mark.parametrize("action", ["enable", "disable", "revoke", "roll", "get"])
    async def test_if_id_unknown_then_key_not_found(self, manager: KeyManager, action: str) -> None:
        with pytest.raises(KeyNotFound):
            await getattr(manager, action)("Z" * 12)

    async def test_if_expired_then_refused_as_expired(self, manager: KeyManager) -> None:
        created = await manager.create(
            name="n", workspace="w", scopes=["contacts:read"], expires_in=timedelta(seconds=0.3)
        )
        await manager.verify(created.key)
        await asyncio.sleep(0.35)
        with pytest.raises(KeyExpired):
            await manager.verify(created.key)
        assert (await manager.get(created.record.id)).status == "expired"

    async def test_if_expired_key_disabled_then_disabled_wins(self, manager: KeyManager) -> None:
        created = await manager.create(
            name="n", workspace="w", scopes=["contacts:read"], expires_in=timedelta(seconds=0.1)
        )
        await asyncio.sleep(0.15)
        await manager.disable(created.record.id)
        with pytest.raises(KeyDisabled):
            await manager.verify(created.key)


class TestRoll:
    async def test_if_rolled_then_new_key_has_same_grants_and_old_works_in_grace(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(
            name="Zapier", workspace="acme", scopes=["contacts:read"], rate_limit="5/second"
        )
        rolled = await manager.roll(created.record.id, grace=timedelta(hours=1))
        assert rolled.key != created.key
        new, old = rolled.record, await manager.get(created.record.id)
        assert (new.name, new.workspace, new.access, new.scopes, new.rate_limit) == (
            "Zapier",
            "acme",
            "restricted",
            ("contacts:read",),
            "5/second",
        )
        assert new.id != old.id
        assert old.expires_at is not None
        assert timedelta(minutes=59) < old.expires_at - datetime.now(UTC) <= timedelta(hours=1)
        await manager.verify(created.key)
        await manager.verify(rolled.key)

    async def test_if_rolled_then_old_and_new_records_link_each_other(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(
            name="Zapier", workspace="acme", scopes=["contacts:read"], expires_in=timedelta(hours=1)
        )
        rolled = await manager.roll(created.record.id, grace=timedelta(days=7))
        old = await manager.get(created.record.id)
        assert rolled.record.replaces == old.id
        assert old.replaced_by == rolled.record.id
        # The link is set even when the grace period does not shorten the old expiry.
        assert old.expires_at == created.record.expires_at
        new = await manager.get(rolled.record.id)
        assert (new.replaces, new.replaced_by) == (old.id, None)
        assert old.to_dict()["replaced_by"] == new.id
        assert new.to_dict()["replaces"] == old.id
        listed = {record.id: record for record in await manager.list("acme")}
        assert listed[old.id].replaced_by == new.id
        assert listed[new.id].replaces == old.id
        # A new key that is rolled again: its record points on to the newest.
        again = await manager.roll(new.id, grace=timedelta(0))
        assert (await manager.get(new.id)).replaced_by == again.record.id
        assert created.record.replaces is None
        assert created.record.replaced_by is None

    async def test_if_grace_over_then_old_key_expired(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        rolled = await manager.roll(created.record.id, grace=timedelta(0))
        with pytest.raises(KeyExpired):
            await manager.verify(created.key)
        await manager.verify(rolled.key)
        assert (await manager.get(created.record.id)).status == "expired"

    async def test_if_rolled_twice_then_grace_never_extends_expiry(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.roll(created.record.id, grace=timedelta(0))
        with pytest.raises(InvalidTransition, match="rolled already"):
            await manager.roll(created.record.id, grace=timedelta(days=7))
        with pytest.raises(KeyExpired):
            await manager.verify(created.key)

    @pytest.mark.parametrize("grace", [timedelta(0), timedelta(hours=24)])
    async def test_if_a_rolled_key_is_rolled_again_then_refused_and_one_successor_lives(
        self, manager: KeyManager, grace: timedelta
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        first = await manager.roll(created.record.id, grace=timedelta(hours=24))
        with pytest.raises(
            InvalidTransition, match=f"roll the key that replaces it, {first.record.id}"
        ):
            await manager.roll(created.record.id, grace=grace)
        records = await manager.list("w")
        assert [r.id for r in records if r.status == "active" and r.replaces] == [first.record.id]
        assert (await manager.get(created.record.id)).replaced_by == first.record.id

    async def test_if_a_disabled_key_is_rolled_then_refused(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.disable(created.record.id)
        with pytest.raises(InvalidTransition, match="disabled: enable it first"):
            await manager.roll(created.record.id)
        assert [r.id for r in await manager.list("w")] == [created.record.id]

    async def test_if_a_rolled_key_in_its_grace_is_disabled_then_refused(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.roll(created.record.id, grace=timedelta(hours=1))
        with pytest.raises(InvalidTransition, match="revoke it to stop it now"):
            await manager.disable(created.record.id)
        await manager.verify(created.key)  # still working through its grace period

    async def test_if_rolled_with_expires_in_then_new_key_expires_then(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        plain = await manager.roll(created.record.id)
        assert plain.record.expires_at is None
        rolled = await manager.roll(plain.record.id, expires_in=timedelta(days=30))
        assert rolled.record.expires_at is not None
        lifetime = rolled.record.expires_at - rolled.record.created_at
        assert abs(lifetime - timedelta(days=30)) < timedelta(seconds=1)

    async def test_if_grace_negative_then_refused(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        with pytest.raises(InvalidKeyParameters):
            await manager.roll(created.record.id, grace=timedelta(seconds=-1))


class TestUsage:
    async def test_if_many_concurrent_verifies_then_count_is_exact(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await asyncio.gather(*(manager.verify(created.key) for _ in range(300)))
        await manager.flush()
        stored = await manager.store.get(created.record.id)
        assert stored is not None
        assert stored.record.request_count == 300
        assert stored.record.last_used_at is not None

    async def test_if_two_managers_share_a_store_then_no_increment_is_lost(
        self, manager: KeyManager, hasher: Hasher
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])

        async def burst(target: KeyManager, count: int) -> None:
            for _ in range(count):
                await target.verify(created.key)
                await asyncio.sleep(0)

        async with KeyManager(manager.store, hasher=hasher, usage_flush_interval=0.01) as other:
            await asyncio.gather(burst(manager, 150), burst(other, 150))
            await manager.flush()
            await other.flush()
        assert (await manager.get(created.record.id)).request_count == 300

    async def test_if_not_flushed_yet_then_get_includes_this_process_counts(
        self, store: KeyStore, hasher: Hasher
    ) -> None:
        lazy = KeyManager(store, hasher=hasher, usage_flush_interval=3600)
        created = await lazy.create(name="n", workspace="w", scopes=["contacts:read"])
        for _ in range(3):
            await lazy.verify(created.key)
        assert (await lazy.get(created.record.id)).request_count == 3
        [listed] = await lazy.list("w")
        assert listed.request_count == 3
        await lazy.aclose()
        stored = await store.get(created.record.id)
        assert stored is not None
        assert stored.record.request_count == 3

    async def test_if_flushed_in_background_then_visible_within_two_seconds(
        self, manager: KeyManager, hasher: Hasher
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        before = datetime.now(UTC)
        await manager.verify(created.key)
        async with KeyManager(manager.store, hasher=hasher) as observer:
            for _ in range(40):
                record = await observer.get(created.record.id)
                if record.request_count == 1:
                    break
                await asyncio.sleep(0.05)
            # The store they share closes with the observer: not under a write in flight.
            await manager.flush()
        assert record.request_count == 1
        assert record.last_used_at is not None
        assert record.last_used_at >= before - timedelta(seconds=1)
        assert isoformat(record.last_used_at).endswith("Z")  # type: ignore[union-attr]

    async def test_if_verify_without_recording_then_count_unchanged(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.verify(created.key, record_usage=False)
        await manager.flush()
        assert (await manager.get(created.record.id)).request_count == 0

    async def test_if_refused_then_not_counted(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.disable(created.record.id)
        with pytest.raises(KeyDisabled):
            await manager.verify(created.key)
        with pytest.raises(InvalidAPIKey):
            await manager.verify(wrong_secret(created.key))
        await manager.flush()
        assert (await manager.get(created.record.id)).request_count == 0


class TestAcrossManagers:
    async def test_if_revoked_through_one_manager_then_other_refuses_next_request(
        self, manager: KeyManager, hasher: Hasher
    ) -> None:
        async with KeyManager(manager.store, hasher=hasher) as other:
            created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
            await other.verify(created.key)
            await manager.revoke(created.record.id)
            with pytest.raises(KeyRevoked):
                await other.verify(created.key)

    async def test_if_disabled_through_one_manager_then_other_refuses_next_request(
        self, manager: KeyManager, hasher: Hasher
    ) -> None:
        async with KeyManager(manager.store, hasher=hasher) as other:
            created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
            await other.verify(created.key)
            await manager.disable(created.record.id)
            with pytest.raises(KeyDisabled):
                await other.verify(created.key)
            await manager.enable(created.record.id)
            await other.verify(created.key)


class TestRollRace:
    async def test_if_revoked_while_rolling_then_roll_refused_and_new_key_revoked(
        self, store: KeyStore, hasher: Hasher
    ) -> None:
        manager = KeyManager(store, hasher=hasher)
        created = await manager.create(name="n", workspace="w", full_access=True)

        class RevokeDuringIssue(Hasher):
            """Revokes the old key from 'another process' while the new one is hashed."""

            async def ahash(self, secret: str) -> str:
                async with KeyManager(store, hasher=hasher) as elsewhere:
                    await elsewhere.revoke(created.record.id)
                return await super().ahash(secret)

        racing = KeyManager(
            store, hasher=RevokeDuringIssue(pepper="1awuN_rKweVSoRxFr2EKGuIxfESTX_x8eXJses89j20")
        )
        try:
            with pytest.raises(InvalidTransition, match="revoked"):
                await racing.roll(created.record.id)
            # The old key and the one the interrupted roll issued: both revoked, none usable.
            assert [record.status for record in await manager.list("w")] == ["revoked", "revoked"]
        finally:
            await racing.aclose()
            await manager.aclose()


class TestKeyPrefixBinding:
    async def test_if_a_test_key_is_re_prefixed_as_live_then_invalid(
        self, store: KeyStore, hasher: Hasher
    ) -> None:
        # Finding 7: two managers on one store; a test key rewritten with the live prefix
        # (checksum recomputed) verified as a live key.
        async with (
            KeyManager(store, hasher=hasher, prefix="sk_test", cache=False) as testing,
            KeyManager(store, hasher=hasher, prefix="sk_live", cache=False) as live,
        ):
            created = await testing.create(name="n", workspace="w", scopes=["contacts:read"])
            parsed = parse_key(created.key)
            forged = type(parsed)("sk_live", parsed.id, parsed.secret).token
            with pytest.raises(InvalidAPIKey):
                await live.verify(forged)
            assert (await testing.verify(created.key)).id == created.record.id

    @given(
        prefixes=st.lists(
            st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True),
            min_size=2,
            max_size=2,
            unique=True,
        )
    )
    @settings(max_examples=30, deadline=None)
    def test_if_token_carries_another_prefix_then_never_verified(self, prefixes: list[str]) -> None:
        issuing_prefix, other_prefix = prefixes
        store = MemoryStore()
        hasher = Hasher(pepper="OEa7r18v_uYePL6WCbrTCX77up9OX95GW-VDf26QEMg")

        async def scenario() -> None:
            async with (
                KeyManager(store, hasher=hasher, prefix=issuing_prefix) as issuing,
                KeyManager(store, hasher=hasher, prefix=other_prefix) as other,
            ):
                created = await issuing.create(name="n", workspace="w", full_access=True)
                parsed = parse_key(created.key)
                # Every prefix the other manager reads (its environments', its bare one)
                # but the very token issued (`a_live` is both `a`'s live keys' and the
                # bare prefix of a manager of `a_live`).
                for forged_prefix in environments_of(other_prefix):
                    if forged_prefix == parsed.prefix:
                        continue
                    forged = type(parsed)(forged_prefix, parsed.id, parsed.secret).token
                    with pytest.raises(InvalidAPIKey):
                        await other.verify(forged)

        asyncio.run(scenario())


class TestRollLifetime:
    async def test_if_rolled_then_the_new_key_lives_as_long_as_the_old_one(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(
            name="n", workspace="w", scopes=["contacts:read"], expires_in=timedelta(days=30)
        )
        rolled = await manager.roll(created.record.id)
        record = rolled.record
        assert record.expires_at is not None
        assert record.expires_at - record.created_at == timedelta(days=30)

    async def test_if_rolled_with_expires_in_then_that_wins(self, manager: KeyManager) -> None:
        created = await manager.create(
            name="n", workspace="w", scopes=["contacts:read"], expires_in=timedelta(days=30)
        )
        rolled = await manager.roll(created.record.id, expires_in=timedelta(days=7))
        record = rolled.record
        assert record.expires_at is not None
        assert record.expires_at - record.created_at == timedelta(days=7)

    async def test_if_the_old_key_never_expires_then_neither_does_the_new(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        assert (await manager.roll(created.record.id)).record.expires_at is None


# Edits `update` refuses before the store is read or written: once each on memory, and all
# of them on every store, which keeps the key as it was.
BAD_EDITS: list[dict[str, Any]] = [
    {"scopes": []},
    {"full_access": True, "scopes": ["contacts:read"]},
    {"scopes": ["Not A Scope"]},
    {"rate_limit": "often"},
    {"name": ""},
    {"expires_in": timedelta(seconds=-1)},
]


class TestUpdate:
    async def test_if_fields_given_then_only_they_change(self, manager: KeyManager) -> None:
        created = await manager.create(
            name="n", workspace="w", scopes=["contacts:read", "contacts:write"]
        )
        key_id = created.record.id
        record = await manager.update(key_id, name="renamed", scopes=["contacts:read"])
        assert (record.name, record.access, record.scopes) == (
            "renamed",
            "restricted",
            ("contacts:read",),
        )
        record = await manager.update(key_id, rate_limit="5/second", expires_in=timedelta(days=1))
        assert record.rate_limit == "5/second"
        assert record.expires_at is not None
        record = await manager.update(key_id, full_access=True, rate_limit=None, expires_at=None)
        assert (record.access, record.scopes, record.rate_limit, record.expires_at) == (
            "full",
            (),
            None,
            None,
        )
        assert (await manager.get(key_id)).to_dict() == record.to_dict()
        assert record.name == "renamed"

    async def test_if_narrowed_then_the_very_next_verification_sees_it(
        self, store: KeyStore, hasher: Hasher
    ) -> None:
        # Two processes' managers on one store, each caching what it verified.
        writer = KeyManager(store, hasher=hasher)
        reader = KeyManager(store, hasher=hasher)
        try:
            created = await writer.create(
                name="n", workspace="w", scopes=["contacts:read", "contacts:write"]
            )
            for _ in range(3):
                assert "contacts:write" in (await reader.verify(created.key)).scopes
            await asyncio.sleep(0.3)  # the reader's cache is proven fresh by now
            assert "contacts:write" in (await reader.verify(created.key)).scopes
            await writer.update(created.record.id, scopes=["contacts:read"])
            assert (await reader.verify(created.key)).scopes == ("contacts:read",)
            await writer.update(created.record.id, expires_in=timedelta(seconds=0.3))
            await asyncio.sleep(0.4)
            with pytest.raises(KeyExpired):
                await reader.verify(created.key)
        finally:
            await reader.aclose()
            await writer.aclose()

    async def test_if_revoked_then_an_edit_is_refused(self, manager: KeyManager) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await manager.revoke(created.record.id)
        with pytest.raises(InvalidTransition):
            await manager.update(created.record.id, name="again")
        assert (await manager.get(created.record.id)).name == "n"

    async def test_if_the_key_is_unknown_then_not_found(self, manager: KeyManager) -> None:
        with pytest.raises(KeyNotFound):
            await manager.update("nosuchkey000", name="x")

    @pytest.mark.parametrize("changes", BAD_EDITS)
    async def test_if_an_edit_is_invalid_then_refused_and_nothing_changes(
        self, memory_manager: KeyManager, changes: dict[str, Any]
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        with pytest.raises(InvalidKeyParameters):
            await memory_manager.update(created.record.id, **changes)
        assert (await memory_manager.get(created.record.id)).to_dict() == created.record.to_dict()

    async def test_if_an_edit_is_invalid_then_no_store_changes_the_key(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        for changes in BAD_EDITS:
            with pytest.raises(InvalidKeyParameters):
                await manager.update(created.record.id, **changes)
            assert (await manager.get(created.record.id)).to_dict() == created.record.to_dict()


# Connections the first loop opened cannot be closed once it is gone: the store lets them
# go and the garbage collector closes their sockets, saying so (collected here, inside the
# test, where those warnings are expected).
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_if_a_store_moves_to_a_new_event_loop_then_it_keeps_working(
    store_url: str, store_options: dict[str, str], hasher: Hasher
) -> None:
    # A key issued with asyncio.run at import time, then the app served on uvicorn's loop:
    # this answered every request with 503 and "Event loop is closed" in the log.
    manager = KeyManager(store_from_url(store_url, **store_options), hasher=hasher)
    created = asyncio.run(manager.create(name="early", workspace="w", full_access=True))

    async def served_later(manager: KeyManager) -> None:
        try:
            assert (await manager.verify(created.key)).id == created.record.id
            await manager.disable(created.record.id)
            with pytest.raises(KeyDisabled):
                await manager.verify(created.key)
            assert (await manager.create(name="later", workspace="w", full_access=True)).key
        finally:
            await manager.aclose()

    asyncio.run(served_later(manager))
    del manager
    gc.collect()


# Rate limits `create` refuses before the store is read or written: once each on memory,
# and all of them on every store, which stays empty.
BAD_RATE_LIMITS: list[tuple[dict[str, Any], str]] = [
    ({"rate_limit": "1/second", "rate_limits": {"a": "1/second"}}, "not both"),
    ({"rate_limits": {}}, "invalid rate limit"),
    ({"rate_limits": {"Burst": "1/second"}}, "not a policy name"),
    ({"rate_limits": {"a": "1/second, b=1/day"}}, "invalid rate limit"),
    ({"rate_limits": {"a": "lots"}}, "invalid rate limit"),
    ({"rate_limits": "a=1/second"}, "mapping"),
    ({"rate_limit": "a=1/second, a=1/day"}, "used twice"),
    ({"rate_limit": "1/second, 1/day"}, "no name"),
]


class TestSeveralRateLimits:
    async def test_if_created_with_a_mapping_then_stored_as_text_and_read_back_as_policies(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(
            name="n",
            workspace="w",
            scopes=["contacts:read"],
            rate_limits={"burst": "10/second", "daily": "10000/day"},
        )
        record = await manager.get(created.record.id)
        assert record.rate_limit == "burst=10/second, daily=10000/day"
        assert record.rate_limits == (
            {"name": "burst", "limit": "10/second"},
            {"name": "daily", "limit": "10000/day"},
        )
        data = record.to_dict()
        assert data["rate_limit"] == "burst=10/second, daily=10000/day"
        assert data["rate_limits"] == [
            {"name": "burst", "limit": "10/second"},
            {"name": "daily", "limit": "10000/day"},
        ]

    async def test_if_created_with_text_then_several_policies_are_accepted_as_written(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(
            name="n", workspace="w", full_access=True, rate_limit="burst=5/second;daily=9/day"
        )
        assert created.record.rate_limit == "burst=5/second;daily=9/day"
        assert [policy["name"] for policy in created.record.rate_limits] == ["burst", "daily"]

    async def test_if_one_limit_or_none_then_rate_limits_says_so(self, manager: KeyManager) -> None:
        one = await manager.create(name="n", workspace="w", full_access=True, rate_limit="5/minute")
        assert one.record.rate_limits == ({"name": "default", "limit": "5/minute"},)
        assert one.record.to_dict()["rate_limits"] == [{"name": "default", "limit": "5/minute"}]
        none = await manager.create(name="n", workspace="w", full_access=True)
        assert none.record.rate_limits == ()
        assert none.record.to_dict()["rate_limits"] == []
        mapped = await manager.create(
            name="n", workspace="w", full_access=True, rate_limits={"default": "5/minute"}
        )
        assert mapped.record.rate_limit == "5/minute"

    @pytest.mark.parametrize(("kwargs", "message"), BAD_RATE_LIMITS)
    async def test_if_policies_invalid_then_refused_and_nothing_stored(
        self, memory_manager: KeyManager, kwargs: dict[str, Any], message: str
    ) -> None:
        with pytest.raises(InvalidKeyParameters, match=message):
            await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"], **kwargs)
        assert await memory_manager.list() == []

    async def test_if_policies_invalid_then_every_store_stays_empty(
        self, manager: KeyManager
    ) -> None:
        for kwargs, message in BAD_RATE_LIMITS:
            with pytest.raises(InvalidKeyParameters, match=message):
                await manager.create(name="n", workspace="w", scopes=["contacts:read"], **kwargs)
        assert await manager.list() == []

    async def test_if_updated_with_a_mapping_then_the_policies_change(
        self, manager: KeyManager
    ) -> None:
        created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
        key_id = created.record.id
        record = await manager.update(key_id, rate_limits={"burst": "1/second", "daily": "5/day"})
        assert record.rate_limit == "burst=1/second, daily=5/day"
        assert (await manager.get(key_id)).rate_limits == record.rate_limits
        record = await manager.update(key_id, rate_limit="hourly=7/hour")
        assert record.rate_limits == ({"name": "hourly", "limit": "7/hour"},)
        with pytest.raises(InvalidKeyParameters, match="not both"):
            await manager.update(key_id, rate_limit=None, rate_limits={"a": "1/second"})
        with pytest.raises(InvalidKeyParameters):
            await manager.update(key_id, rate_limits={"a": "1/second", "b": "zero"})
        assert (await manager.get(key_id)).rate_limit == "hourly=7/hour"

    async def test_if_rolled_then_the_new_key_keeps_the_policies(self, manager: KeyManager) -> None:
        created = await manager.create(
            name="n", workspace="w", full_access=True, rate_limits={"a": "1/second", "b": "2/day"}
        )
        new = await manager.roll(created.record.id)
        assert new.record.rate_limit == "a=1/second, b=2/day"

    def test_if_stored_text_is_not_apikeys_notation_then_shown_as_is(self) -> None:
        record = KeyRecord(
            id="abcdefghijkl",
            name="n",
            workspace="w",
            prefix="ak_abcdefghijkl_…",
            access="full",
            scopes=(),
            state="active",
            rate_limit="lots",
            created_at=datetime.now(UTC),
        )
        assert record.to_dict()["rate_limits"] == [{"name": "default", "limit": "lots"}]


async def test_if_closed_right_after_its_first_verification_then_aclose_returns(
    store: KeyStore, hasher: Hasher
) -> None:
    # The first verification starts the cache's probing; on Redis, a cancellation arriving
    # as a probe command was answered used to be swallowed, and aclose waited forever.
    for _ in range(5):
        manager = KeyManager(store, hasher=hasher)
        created = await manager.create(name="n", workspace="w", full_access=True)
        await manager.verify(created.key)
        async with asyncio.timeout(10):
            await manager.aclose()


async def test_a_memory_store_subclass_that_overrides_its_reads_is_verified_through_them(
    hasher: Hasher,
) -> None:
    class DownStore(MemoryStore):
        def get_for_verification_now(self, key_id: str) -> Any:
            raise ConnectionError("down")

    class DownForVerification(DownStore):
        def get_for_verification_now(self, key_id: str) -> Any:
            return False  # to be awaited

        async def get_for_verification(self, key_id: str) -> Any:
            return self._keys.get(key_id)

    for store, fails in ((DownStore(), True), (DownForVerification(), False)):
        async with KeyManager(store, hasher=hasher) as manager:
            created = await manager.create(name="n", full_access=True)
            if fails:
                with pytest.raises(ConnectionError):
                    await manager.verify(created.key)
            else:
                assert (await manager.verify(created.key)).id == created.record.id


async def test_an_unknown_id_and_a_wrong_secret_do_the_same_hash_work(
    manager: KeyManager, hasher: Hasher
) -> None:
    created = await manager.create(name="n", workspace="w", scopes=["contacts:read"])
    calls: list[str] = []
    original = manager.hasher.verify
    original_matcher = manager.hasher.matcher

    def counted(secret: str, stored: str) -> Any:
        calls.append(stored)
        return original(secret, stored)

    # A key the manager holds is checked by its hash's prepared check (Hasher.matcher):
    # counted as a hash too.
    def counted_matcher(stored: str) -> Any:
        matches = original_matcher(stored)
        if matches is None:
            return None

        def counting(secret: str) -> bool:
            calls.append(stored)
            return matches(secret)

        return counting

    manager.hasher.verify = counted  # type: ignore[method-assign]
    manager.hasher.matcher = counted_matcher  # type: ignore[method-assign]
    with pytest.raises(InvalidAPIKey):
        await manager.verify(wrong_secret(created.key))
    with pytest.raises(InvalidAPIKey):
        await manager.verify(generate_key(key_id="Q" * 12).token)
    assert len(calls) == 2


# -- a store that cannot be reached at startup -------------------------------------------------


def _refused_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("kind", "shown", "cause"),
    [
        pytest.param(
            "postgresql://bob:s3cret@127.0.0.1:{port}/keys",
            "postgresql://bob:***@127.0.0.1:{port}/keys",
            "ConnectionRefusedError: ",
            id="postgres",
        ),
        pytest.param(
            "redis://:s3cret@127.0.0.1:{port}/13",
            "redis://:***@127.0.0.1:{port}/13",
            "ConnectionError: ",
            id="redis",
        ),
        pytest.param(
            "sqlite:///{tmp}/no-such-folder/keys.db",
            "sqlite:///{tmp}/no-such-folder/keys.db",
            "FileNotFoundError: no folder '{tmp}/no-such-folder'",
            id="sqlite",
        ),
    ],
)
@pytest.mark.parametrize("given_as", ["url", "store"])
async def test_if_the_store_is_unreachable_at_startup_then_the_log_and_error_name_it(
    kind: str,
    shown: str,
    cause: str,
    given_as: str,
    tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What an operator reads when the app cannot start: which store (password masked) and
    # why, as the CLI says it; never only the text meant for API clients.
    values = {"port": _refused_port(), "tmp": str(tmp_path)}
    url, shown, cause = (text.format(**values) for text in (kind, shown, cause))
    store = store_from_url(url)
    manager = KeyManager(url if given_as == "url" else store)
    with pytest.raises(StoreUnavailable) as raised:
        async with manager:
            pass
    message = str(raised.value)
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert logged == [f"apikeys: {message}"]
    # A store given as an object is named by its repr, which never holds a password.
    where = shown if given_as == "url" else repr(store)
    assert message.startswith(f"key store unavailable: {where}: {cause}")
    assert "s3cret" not in message
    assert "cannot be checked right now" not in message
    # Clients are still told only that authentication is unavailable.
    assert raised.value.detail == "API keys cannot be checked right now. Retry shortly."


# -- the pepper a store's keys are hashed with -------------------------------------------------

OTHER_PEPPER = "7Ni5UVGoLOPnmry5rUJcOow2UG0wqOE86SfeOOQZE8E"


async def test_if_a_process_starts_with_another_pepper_then_it_refuses_and_says_why(
    store_url: str,
    store_options: dict[str, str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The store records a fingerprint of the pepper (never the pepper); a process whose
    # pepper differs refuses to start, where it once answered every key invalid_api_key.
    monkeypatch.delenv("APIKEYS_PEPPER", raising=False)
    monkeypatch.delenv("APIKEYS_OLD_PEPPERS", raising=False)
    memory = MemoryStore()

    def manager(hasher: Hasher) -> KeyManager:
        store = memory if store_url == "memory://" else store_from_url(store_url, **store_options)
        return KeyManager(store, hasher=hasher)

    async with manager(Hasher(TEST_PEPPER)) as first:
        created = await first.create(name="n", full_access=True)
    with pytest.raises(ConfigurationError) as refused:
        async with manager(Hasher(OTHER_PEPPER)):
            pass
    message = str(refused.value)
    assert "another pepper" in message
    assert "APIKEYS_PEPPER" in message
    for secret in (TEST_PEPPER, OTHER_PEPPER):
        assert secret not in message
        assert secret not in caplog.text
    # Without a pepper at all, too.
    with pytest.raises(ConfigurationError):
        async with manager(Hasher()):
            pass
    # The right pepper, or the old one listed while rotating, starts; after a rotation the
    # store records the new pepper, and the old one alone no longer starts.
    async with manager(Hasher(TEST_PEPPER)) as same:
        assert (await same.verify(created.key, record_usage=False)).id == created.record.id
    async with manager(Hasher(OTHER_PEPPER, old_peppers=[TEST_PEPPER])) as rotating:
        assert (await rotating.verify(created.key, record_usage=False)).id == created.record.id
    with pytest.raises(ConfigurationError):
        async with manager(Hasher(TEST_PEPPER)):
            pass


@pytest.mark.sqlite
async def test_a_middleware_without_a_lifespan_refuses_another_pepper_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # No `async with manager`, no lifespan: the pepper is checked before the first read of
    # the store, and a mismatch answers 503 with the reason logged, never 401 for every key.
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    async with KeyManager(url, hasher=Hasher(TEST_PEPPER)) as first:
        created = await first.create(name="n", full_access=True)

    async def hello(request: Any) -> PlainTextResponse:
        return PlainTextResponse("hello")

    for pepper, status in ((OTHER_PEPPER, 503), (TEST_PEPPER, 200)):
        manager = KeyManager(url, hasher=Hasher(pepper))
        app = APIKeyMiddleware(
            Starlette(routes=[Route("/api/hello", hello)]), manager=manager, protect="/api/"
        )
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                for _ in range(2):  # refused at every request while the pepper differs
                    answer = await http.get(
                        "/api/hello", headers={"Authorization": f"Bearer {created.key}"}
                    )
                    assert answer.status_code == status
        finally:
            await manager.aclose()
    assert "another pepper" in caplog.text
    # Said as the configuration error it is: one plain line, not a crash's traceback.
    told = [r for r in caplog.records if "another pepper" in r.getMessage()]
    assert told
    assert all(r.exc_info is None for r in told)
    assert "unexpected error" not in caplog.text
    for secret in (TEST_PEPPER, OTHER_PEPPER):
        assert secret not in caplog.text


@pytest.mark.sqlite
@pytest.mark.redis
@pytest.mark.parametrize("kind", ["url", "not native"])
async def test_if_channel_is_a_url_or_a_channel_that_is_not_the_stores_own_then_refused(
    kind: str, tmp_path: Path
) -> None:
    # A channel apart from the store's own change log could miss a writer: refused, not
    # ignored, and before the manager makes anything.
    from apikeys.stores.redis.channel import RedisChannel

    store = SQLStore(f"sqlite+aiosqlite:///{tmp_path / 'keys.db'}")
    channel: Any = (
        "redis://127.0.0.1:6379/13"
        if kind == "url"
        else RedisChannel("redis://127.0.0.1:6379/13", native=False)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigurationError, match="channel"):
            KeyManager(store, hasher=Hasher(TEST_PEPPER), channel=channel)
    assert not (tmp_path / "keys.db").exists()
    # The supported form: the store's own channel (what the manager picks without one).
    own = store.channel()
    assert own is not None
    async with KeyManager(store, hasher=Hasher(TEST_PEPPER), channel=own) as manager:
        assert manager.cache is not None
        assert manager.cache.channel is own


class TestSharedLimiter:
    """`KeyManager.limiter`: the limiter the integrations share unless given another."""

    async def test_if_none_given_then_one_in_memory_made_once(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from limits.aio.storage import MemoryStorage

        monkeypatch.delenv("APIKEYS_LIMITER_URL", raising=False)
        async with KeyManager(MemoryStore()) as manager:
            assert manager.limiter is manager.limiter
            assert isinstance(manager.limiter.storage, MemoryStorage)

    async def test_if_the_environment_names_a_redis_then_it_is_used(
        self, monkeypatch: pytest.MonkeyPatch, redis_url: str
    ) -> None:
        from limits.aio.storage import RedisStorage

        monkeypatch.setenv("APIKEYS_LIMITER_URL", redis_url)
        async with KeyManager(MemoryStore()) as manager:
            assert isinstance(manager.limiter.storage, RedisStorage)

    async def test_if_a_limiter_is_given_then_it_is_used_and_left_open(self) -> None:
        from apikeys import RateLimiter

        closed: list[bool] = []

        class Given(RateLimiter):
            async def aclose(self) -> None:
                closed.append(True)

        given_limiter = Given("5/second")
        async with KeyManager(MemoryStore(), limiter=given_limiter) as manager:
            assert manager.limiter is given_limiter
        assert closed == []

    def test_if_the_limiter_url_is_unknown_then_refused_when_built(self) -> None:
        with pytest.raises(ConfigurationError, match="unknown limiter storage"):
            KeyManager(MemoryStore(), limiter="mongodb://nowhere")


async def test_writing_usage_counts_keeps_the_keys_in_use_in_the_key_cache(
    manager: KeyManager,
) -> None:
    # Each process writes its counts about every second: were that a change a key cache
    # drops a key for, every key in use would be read from the store again each second.
    cache = manager.cache
    if cache is None:
        pytest.skip("a store without a key cache")
    made = [
        await manager.create(name=f"n{i}", workspace="w", scopes=["contacts:read"])
        for i in range(3)
    ]
    await manager.verify(made[0].key)  # starts the cache
    for _ in range(3000):  # a bound on a hang (30 s), not a timing
        if cache.fresh:
            break
        await asyncio.sleep(0.01)
    assert cache.fresh
    for created in made:
        await manager.verify(created.key)
    assert len(cache) == len(made)
    await manager.usage_buffer.flush()
    await cache.channel.probe()  # what the store announced before this has arrived
    assert len(cache) == len(made)
    assert [(await manager.get(c.record.id)).request_count for c in made] == [2, 1, 1]
    # A change of one of them still drops it.
    await manager.disable(made[0].record.id)
    await cache.channel.probe()
    assert len(cache) == len(made) - 1
