"""The request path's answers that need no await: `KeyManager.verify_now` decides what
`verify` decides, and `RateLimiter.charge` what `hit` decides, or they say that they
cannot (None; the awaitable that asks the server)."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apikeys import (
    AuthenticationError,
    Hasher,
    InvalidAPIKey,
    KeyManager,
    KeyRevoked,
    MalformedAPIKey,
    MemoryStore,
    PolicyStatus,
    RateLimiter,
)
from apikeys.gate import Gate
from apikeys.hashing import slow_context
from apikeys.ratelimit import Charge, Plan
from apikeys.ratelimit.decisions import decision
from apikeys.types import KeyRecord, StoredKey

from .conftest import TEST_PEPPER


async def _verify_now_eventually(manager: KeyManager, token: str) -> object:
    """`verify_now`, asked until the key cache has proved itself fresh (a few probes)."""
    deadline = time.monotonic() + 10
    while True:
        record = manager.verify_now(token)
        if record is not None or time.monotonic() > deadline:
            return record
        await manager.verify(token, record_usage=False)
        await asyncio.sleep(0.05)


async def test_a_key_the_manager_holds_is_verified_without_awaiting(manager: KeyManager) -> None:
    created = await manager.create(name="fast", scopes=["contacts:read"])
    record = await _verify_now_eventually(manager, created.key)
    # Every store: the memory store at once, the others from the key cache once it is fresh.
    assert record is not None
    assert record == created.record
    before = manager.usage_buffer.pending_daily(created.record.id)
    assert manager.verify_now(created.key) == created.record
    after = manager.usage_buffer.pending_daily(created.record.id)
    assert sum(after.values()) == sum(before.values()) + 1  # the request is counted


async def test_verify_now_refuses_what_verify_refuses(memory_manager: KeyManager) -> None:
    created = await memory_manager.create(name="fast", scopes=["contacts:read"])
    wrong = created.key[:-20] + ("A" if created.key[-20] != "A" else "B") + created.key[-19:]
    with pytest.raises(MalformedAPIKey):  # the checksum no longer matches
        memory_manager.verify_now(wrong)
    with pytest.raises(MalformedAPIKey):
        memory_manager.verify_now("not a key")
    other = await memory_manager.create(name="other", scopes=["contacts:read"])
    # The right id with another key's secret (and a checksum that matches): invalid.
    from apikeys.keys import ParsedKey, split_key

    prefix, key_id, _ = split_key(created.key)
    forged = ParsedKey(prefix, key_id, split_key(other.key)[2]).token
    with pytest.raises(InvalidAPIKey):
        memory_manager.verify_now(forged)
    await memory_manager.revoke(created.record.id)
    with pytest.raises(KeyRevoked):
        memory_manager.verify_now(created.key)


async def test_verify_now_leaves_to_verify_what_needs_it(memory_manager: KeyManager) -> None:
    created = await memory_manager.create(name="fast", scopes=["contacts:read"])
    # An unknown id: verify checks it against the decoy and refuses it.
    from apikeys.keys import generate_key

    unknown = generate_key().token
    assert memory_manager.verify_now(unknown) is None
    with pytest.raises(InvalidAPIKey):
        await memory_manager.verify(unknown)
    assert memory_manager.verify_now(created.key) is not None

    # Telemetry on: verify times and reports it.
    events: list[object] = []
    watched = KeyManager(
        memory_manager.store, hasher=Hasher(pepper=TEST_PEPPER), on_event=events.append
    )
    try:
        assert watched.verify_now(created.key) is None
        assert (await watched.verify(created.key)).id == created.record.id
    finally:
        await watched.aclose()


async def test_a_slow_hash_is_never_checked_without_awaiting() -> None:
    # `averify` checks a slow hash in a worker thread, within the failure budget; once it
    # had, verify_now must still leave the key to it rather than hash on the event loop.
    hasher = Hasher(pepper=TEST_PEPPER, context=slow_context("pbkdf2_sha256"))
    manager = KeyManager(MemoryStore(), hasher=hasher)
    try:
        created = await manager.create(name="slow", scopes=["contacts:read"])
        assert manager.verify_now(created.key) is None
        assert (await manager.verify(created.key)).id == created.record.id
        assert manager.verify_now(created.key) is None
        stored = await manager.store.get(created.record.id)
        assert stored is not None
        assert hasher.verify_fast(created.key, stored.secret_hash) is None
    finally:
        await manager.aclose()


class CountingStore(MemoryStore):
    """A test double that counts reads: the request path must still go through it."""

    reads = 0

    def get_for_verification_now(self, key_id: str) -> Literal[False]:
        return False  # to be awaited, as a store out of process is

    async def get_for_verification(self, key_id: str) -> StoredKey | None:
        CountingStore.reads += 1
        return await super().get_for_verification(key_id)


async def test_a_store_that_must_be_awaited_is_read_every_time() -> None:
    manager = KeyManager(CountingStore(), hasher=Hasher(pepper=TEST_PEPPER))
    try:
        created = await manager.create(name="counted", scopes=["contacts:read"])
        assert manager.verify_now(created.key) is None
        reads = CountingStore.reads
        await manager.verify(created.key)
        assert CountingStore.reads == reads + 1
    finally:
        await manager.aclose()


async def test_the_memory_limiter_decides_without_awaiting() -> None:
    limiter = RateLimiter("3/minute", "memory://")
    plan = limiter.plan("k")

    def now() -> PolicyStatus | None:
        charged = limiter.charge(plan)
        return decision(plan, charged).policies[0] if isinstance(charged, tuple) else None

    try:
        first = now()
        assert first is not None
        assert (first.allowed, first.remaining) == (True, 2)
        second = await limiter.hit("k")  # the same counter
        assert (second.allowed, second.remaining) == (True, 1)
        third = now()
        assert third is not None
        assert third.allowed
        refused = [now() for _ in range(3)]
        assert all(d is not None and not d.allowed for d in refused)
        # A refused request is charged nothing: one refund brings back one request.
        await limiter.refund("k")
        again = now()
        assert again is not None
        assert again.allowed
        assert again.remaining == 0
        assert 1 <= again.reset_after <= 60
    finally:
        await limiter.aclose()


async def test_a_shared_limiter_without_a_lease_asks_redis(
    redis_url: str, redis_key_prefix: str
) -> None:
    limiter = RateLimiter("1000/minute", redis_url, key_prefix=redis_key_prefix)
    try:
        plan = limiter.plan("k")
        asking = limiter.charge(plan)
        assert not isinstance(asking, tuple)  # nothing leased yet: Redis is asked
        first = decision(plan, await asking).policies[0]
        assert first.allowed
        # The lease just taken answers the next requests without a round trip.
        following = limiter.charge(plan)
        assert isinstance(following, tuple)
        assert decision(plan, following).allowed
        assert decision(plan, following).policies[0].remaining == first.remaining - 1
    finally:
        await limiter.aclose()


class RefusingLimiter(RateLimiter):
    """A test double that overrides `charge` only: every request must still reach it."""

    def charge(self, plan: Plan, cost: int = 1) -> Charge:
        return (~0, 60)  # none left, for 60 seconds


class CountingManager(KeyManager):
    """A test double that overrides `verify` only: every request must still reach it."""

    verified = 0

    async def verify(self, token: str, *, record_usage: bool = True) -> KeyRecord:
        CountingManager.verified += 1
        return await super().verify(token, record_usage=record_usage)


async def test_subclasses_that_override_the_awaited_methods_are_not_bypassed() -> None:
    limiter = RefusingLimiter("10/minute", "memory://")
    manager = CountingManager(CountingStore(), hasher=Hasher(pepper=TEST_PEPPER))
    try:
        assert not (await limiter.hit("k")).allowed
        created = await manager.create(name="counted", scopes=["contacts:read"])
        assert manager.verify_now(created.key) is None
        assert (await manager.verify(created.key)).id == created.record.id
        assert CountingManager.verified == 1
    finally:
        await limiter.aclose()
        await manager.aclose()


async def test_a_limiter_that_overrides_charge_refuses_the_gates_first_call() -> None:
    limiter = RefusingLimiter("10/minute", "memory://")
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER))
    try:
        created = await manager.create(name="refused", scopes=["contacts:read"])
        scope = {
            "type": "http",
            "method": "GET",
            "path": "/",
            "headers": [(b"authorization", f"Bearer {created.key}".encode())],
        }
        with pytest.raises(AuthenticationError) as refusal:
            Gate(manager, limiter=limiter).decide(scope, "/")  # no await: charged by it
        assert refusal.value.code == "rate_limited"
    finally:
        await limiter.aclose()
        await manager.aclose()


class NowCountingManager(KeyManager):
    """A test double that overrides `verify_now` only: `verify` must still ask it first."""

    asked = 0

    def verify_now(self, token: str, *, count: bool = True) -> KeyRecord | None:
        NowCountingManager.asked += 1
        return super().verify_now(token, count=count)


async def test_verify_asks_a_subclass_verify_now_first() -> None:
    manager = NowCountingManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER))
    try:
        created = await manager.create(name="counted", scopes=["contacts:read"])
        assert (await manager.verify(created.key)).id == created.record.id
        assert NowCountingManager.asked == 1
    finally:
        await manager.aclose()


# Tokens near a held key's: the key itself, one character changed (to anything), another
# secret with its own checksum, the key's body with another checksum, cut or lengthened.
_CHARS = st.characters(codec="utf-8", exclude_categories=("Cs",))


def _near(key: str, other_secret: str) -> st.SearchStrategy[str]:
    from apikeys.keys import ParsedKey, split_key

    prefix, key_id, _ = split_key(key)
    return st.one_of(
        st.just(key),
        st.builds(
            lambda at, char: key[: at % len(key)] + char + key[at % len(key) + 1 :],
            st.integers(0, 10_000),
            _CHARS,
        ),
        st.just(ParsedKey(prefix, key_id, other_secret).token),
        st.builds(lambda tail: key[:-6] + tail, st.text(_CHARS, min_size=6, max_size=6)),
        st.builds(lambda cut: key[:cut], st.integers(0, len(key) - 1)),
        st.builds(lambda extra: key + extra, st.text(_CHARS, min_size=1, max_size=3)),
    )


def _expected(token: str, key: str) -> str:
    """What `verify_now` answered before it split tokens by position: the full split's
    verdict first, then the held key's."""
    from apikeys.importing.foreign import is_foreign_token
    from apikeys.keys import environments_of, prefixes_splitter, split_key

    try:
        prefix, key_id, secret = prefixes_splitter(environments_of("ak"))(token)
    except MalformedAPIKey:
        return "left to verify" if is_foreign_token(token, "ak") else "malformed"
    if key_id != split_key(key)[1] or prefix != split_key(key)[0]:
        # Not held, or another prefix than the held key's: the store decides (and refuses
        # a key of another prefix as unknown, against the decoy).
        return "left to verify"
    return "admitted" if secret == split_key(key)[2] else "invalid"


@given(data=st.data())
@settings(max_examples=300, deadline=None)
def test_verify_now_answers_every_token_near_a_held_key_as_the_full_split_did(
    data: st.DataObject,
) -> None:
    """Whatever came before (the memo of the checksum that matched fills at the key's
    first admitted request), each token gets the full split's answer."""

    async def scenario() -> None:
        manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER))
        try:
            created = await manager.create(name="k", scopes=["contacts:read"])
            other = await manager.create(name="other", scopes=["contacts:read"])
            from apikeys.keys import split_key

            near = _near(created.key, split_key(other.key)[2])
            tokens = data.draw(st.lists(near, min_size=1, max_size=8))
            for token in tokens:
                expected = _expected(token, created.key)
                try:
                    answer = manager.verify_now(token)
                except MalformedAPIKey:
                    got = "malformed"
                except InvalidAPIKey:
                    got = "invalid"
                else:
                    got = "left to verify" if answer is None else "admitted"
                    if answer is not None:
                        assert answer == created.record
                assert got == expected, token
        finally:
            await manager.aclose()

    asyncio.run(scenario())


async def test_a_token_with_a_lone_surrogate_is_malformed_not_an_encoding_error(
    memory_manager: KeyManager,
) -> None:
    created = await memory_manager.create(name="k", scopes=["contacts:read"])
    assert memory_manager.verify_now(created.key) == created.record  # the key is held
    odd = created.key[:-10] + "\ud800" + created.key[-9:]  # same length, its secret not text
    with pytest.raises(MalformedAPIKey):
        memory_manager.verify_now(odd)
    with pytest.raises(MalformedAPIKey):
        await memory_manager.verify(odd)
