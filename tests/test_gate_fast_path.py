"""`Gate.decide`, the one body of `admit`: the common case answered by its first call,
without an await, as `admit` answers it; every other case answered once what it needs is
loaded (`Gate.complete`), charged and counted once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apikeys import AuthenticationError, Hasher, KeyManager, MemoryStore, RateLimiter
from apikeys.gate import Admission, APIKeyAuth, APIKeyUser, Gate
from tests import services
from tests.conftest import delete_redis_keys, delete_redis_keys_now, redis_prefix

PATH = "/api/v1/contacts"


def _scope(token: str, method: str = "GET") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": PATH,
        "headers": [(b"authorization", f"Bearer {token}".encode())],
        "client": ("10.0.0.1", 1234),
    }


def _gate(manager: KeyManager, limit: str = "5/minute") -> Gate:
    return Gate(
        manager,
        limiter=RateLimiter(limit),
        scopes={f"GET {PATH}": "contacts:read", f"POST {PATH}": "contacts:write"},
    )


def _admitted(manager: KeyManager, key_id: str) -> int:
    return sum(
        count
        for (_, outcome), count in manager.usage_buffer.pending_daily(key_id).items()
        if outcome == "admitted"
    )


async def test_the_common_case_is_answered_by_the_first_call_as_admit_answers_it(
    memory_manager: KeyManager,
) -> None:
    created = await memory_manager.create(name="k", scopes=["contacts:read"])
    fast_gate, general_gate = _gate(memory_manager), _gate(memory_manager)
    fast, general = _scope(created.key), _scope(created.key)
    headers = fast_gate.decide(fast, PATH)
    assert type(headers) is list
    assert headers == await general_gate.admit(general, PATH)
    assert headers == [(b"ratelimit-policy", b'"default";q=5;w=60'), (b"ratelimit", headers[1][1])]
    assert headers[1][1].startswith(b'"default";r=4;t=')
    for key in ("apikey", "auth", "user"):
        assert fast[key] == general[key] or key != "apikey"
    assert fast["apikey"] == created.record
    assert list(fast["auth"].scopes) == list(general["auth"].scopes) == ["contacts:read"]
    assert fast["user"].identity == created.record.id
    assert _admitted(memory_manager, created.record.id) == 2  # each request counted once


async def test_refusals_are_the_same_and_booked_the_same(memory_manager: KeyManager) -> None:
    created = await memory_manager.create(name="k", scopes=["contacts:read"], rate_limit="1/minute")
    # The scope: a POST needs contacts:write.
    fast_gate, general_gate = _gate(memory_manager, "10/minute"), _gate(memory_manager, "10/minute")
    scoped = await memory_manager.create(name="s", scopes=["contacts:read"])
    with pytest.raises(AuthenticationError) as fast_refusal:
        fast_gate.decide(_scope(scoped.key, "POST"), PATH)
    with pytest.raises(AuthenticationError) as general_refusal:
        await general_gate.admit(_scope(scoped.key, "POST"), PATH)
    assert fast_refusal.value.code == general_refusal.value.code == "insufficient_scope"
    assert fast_refusal.value.headers == general_refusal.value.headers
    daily = memory_manager.usage_buffer.pending_daily(scoped.record.id)
    assert sum(c for (_, o), c in daily.items() if o == "insufficient_scope") == 2
    assert _admitted(memory_manager, scoped.record.id) == 0
    # The rate limit: the key's own 1/minute, spent by the first request of each gate.
    limited = _gate(memory_manager)
    assert type(limited.decide(_scope(created.key), PATH)) is list
    with pytest.raises(AuthenticationError) as refusal:
        limited.decide(_scope(created.key), PATH)
    assert refusal.value.code == "rate_limited"
    assert (b"ratelimit-policy", b'"default";q=1;w=60') in refusal.value.headers
    # A wrong secret: refused, with admit's error.
    wrong = created.key[:-12] + ("A" if created.key[-12] != "A" else "B") + created.key[-11:]
    with pytest.raises(AuthenticationError) as bad:
        limited.decide(_scope(wrong), PATH)
    assert bad.value.code in {"malformed_api_key", "invalid_api_key"}


async def test_a_key_with_credits_needs_its_spend_loaded_and_is_counted_once(
    memory_manager: KeyManager,
) -> None:
    created = await memory_manager.create(name="k", scopes=["contacts:read"], credits=10)
    gate = _gate(memory_manager)
    scope = _scope(created.key)
    answer = gate.decide(scope, PATH)
    assert isinstance(answer, Admission)  # credits are spent by an await
    assert "apikey" not in scope
    assert _admitted(memory_manager, created.record.id) == 0
    headers = await gate.complete(scope, PATH, (), answer)  # the shell loads, counted once
    assert scope["apikey"] == created.record
    assert any(name == b"ratelimit" and b'"credits";r=9' in value for name, value in headers)
    assert _admitted(memory_manager, created.record.id) == 1
    # Its next requests: verified once each, by the first call, never again by the shell.
    verified = []
    verify_now = memory_manager.verify_now

    def counting(token: str, **options: Any) -> Any:
        verified.append(token)
        return verify_now(token, **options)

    memory_manager.verify_now = counting  # type: ignore[method-assign]
    for left in (8, 7):
        scope = _scope(created.key)
        answer = gate.decide(scope, PATH)
        assert isinstance(answer, Admission)
        headers = await gate.complete(scope, PATH, (), answer)
        assert any(f'"credits";r={left}'.encode() in value for _, value in headers)
    assert len(verified) == 2
    assert _admitted(memory_manager, created.record.id) == 3


async def test_several_limits_and_an_allowlist_are_answered_by_the_first_call_as_admit_answers(
    memory_manager: KeyManager,
) -> None:
    created = await memory_manager.create(
        name="k",
        scopes=["contacts:read"],
        rate_limits={"burst": "2/minute", "daily": "100/day"},
        allowed_ips=["10.0.0.0/8"],
    )
    fast_gate, general_gate = _gate(memory_manager), _gate(memory_manager)
    for _ in range(2):
        fast = fast_gate.decide(_scope(created.key), PATH)
        assert type(fast) is list
        assert fast == await general_gate.admit(_scope(created.key), PATH)
    assert fast[0] == (b"ratelimit-policy", b'"burst";q=2;w=60, "daily";q=100;w=86400')
    with pytest.raises(AuthenticationError) as fast_refusal:
        fast_gate.decide(_scope(created.key), PATH)  # burst spent
    with pytest.raises(AuthenticationError) as general_refusal:
        await general_gate.admit(_scope(created.key), PATH)
    refusals = [fast_refusal.value, general_refusal.value]
    assert [refusal.code for refusal in refusals] == ["rate_limited", "rate_limited"]
    assert refusals[0].headers == refusals[1].headers
    # The address: checked before any charge, from another network refused by both.
    elsewhere = {**_scope(created.key), "client": ("192.0.2.1", 1234)}
    with pytest.raises(AuthenticationError) as fast_address:
        fast_gate.decide(dict(elsewhere), PATH)
    with pytest.raises(AuthenticationError) as general_address:
        await general_gate.admit(dict(elsewhere), PATH)
    assert fast_address.value.code == general_address.value.code == "ip_not_allowed"
    daily = memory_manager.usage_buffer.pending_daily(created.record.id)
    assert sum(c for (_, o), c in daily.items() if o == "ip_not_allowed") == 2
    assert sum(c for (_, o), c in daily.items() if o == "rate_limited") == 2
    assert _admitted(memory_manager, created.record.id) == 4


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"authorization", b"Basic abc")],
        [(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")],
        [(b"authorization", "Bearer ключ".encode())],
    ],
)
async def test_a_header_out_of_the_common_case_is_refused_by_the_first_call_as_by_admit(
    memory_manager: KeyManager, headers: list[tuple[bytes, bytes]]
) -> None:
    gate = _gate(memory_manager)
    scope = {**_scope("x"), "headers": headers}
    with pytest.raises(AuthenticationError) as first:
        gate.decide(scope, PATH)
    with pytest.raises(AuthenticationError) as admitted:
        await gate.admit(scope, PATH)
    assert first.value.code == admitted.value.code
    assert "apikey" not in scope


async def test_telemetry_on_has_every_key_verified_by_the_awaited_verify(
    memory_manager: KeyManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = await memory_manager.create(name="k", scopes=["contacts:read"])
    monkeypatch.setattr(memory_manager.telemetry, "active", True)
    assert isinstance(_gate(memory_manager).decide(_scope(created.key), PATH), Admission)


async def test_the_shared_auth_and_user_are_read_only(memory_manager: KeyManager) -> None:
    created = await memory_manager.create(name="k", scopes=["contacts:read"])
    gate = _gate(memory_manager)
    first, second = _scope(created.key), _scope(created.key)
    gate.decide(first, PATH)
    gate.decide(second, PATH)
    assert isinstance(first["auth"], APIKeyAuth)
    assert isinstance(first["user"], APIKeyUser)
    with pytest.raises(AttributeError):
        first["auth"].scopes = ["admin:*"]
    with pytest.raises(AttributeError):
        first["user"].record = None
    assert list(second["auth"].scopes) == ["contacts:read"]


async def test_a_changed_key_is_decided_by_its_new_version_on_every_store(
    manager: KeyManager,
) -> None:
    """What the core made of a key's version is never used for another: a key's scopes
    taken away, then the key revoked, are seen at once (through the key cache on the
    stores that have one)."""
    created = await manager.create(name="k", scopes=["contacts:read"])
    gate = _gate(manager, "1000/minute")
    deadline = time.monotonic() + 10
    while type(gate.decide(_scope(created.key), PATH)) is not list:  # until the cache is fresh
        assert time.monotonic() < deadline
        await gate.admit(_scope(created.key), PATH)
        await asyncio.sleep(0.05)
    await manager.update(created.record.id, scopes=["contacts:write"])
    with pytest.raises(AuthenticationError) as refusal:
        await gate.admit(_scope(created.key), PATH)
    assert refusal.value.code == "insufficient_scope"
    await manager.revoke(created.record.id)
    for _ in range(3):
        with pytest.raises(AuthenticationError) as refusal:
            await gate.admit(_scope(created.key), PATH)
        assert refusal.value.code == "key_revoked"


async def test_a_gate_without_a_limiter_shares_the_managers(memory_manager: KeyManager) -> None:
    assert Gate(memory_manager).limiter is memory_manager.limiter


# --- a Redis limiter: the first call spends the units this process leased of a window -----


def _redis_gate(manager: KeyManager, limit: str, prefix: str) -> Gate:
    return Gate(
        manager,
        limiter=RateLimiter(limit, services.REDIS_URL, key_prefix=prefix),
        scopes={f"GET {PATH}": "contacts:read", f"POST {PATH}": "contacts:write"},
    )


@pytest.fixture
def lease_prefix() -> Iterator[str]:
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    prefix = redis_prefix("gate")
    try:
        yield prefix
    finally:
        delete_redis_keys_now(services.REDIS_URL, f"*{prefix}*")


@pytest.mark.redis
async def test_with_a_redis_limiter_the_first_call_decides_once_this_process_holds_a_lease(
    memory_manager: KeyManager, lease_prefix: str
) -> None:
    created = await memory_manager.create(name="k", scopes=["contacts:read"])
    gate = _redis_gate(memory_manager, "1000/minute", lease_prefix)
    try:
        # No lease yet: only Redis can decide, and nothing is charged or counted meanwhile.
        first = _scope(created.key)
        answer = gate.decide(first, PATH)
        assert isinstance(answer, Admission)
        assert "apikey" not in first
        assert _admitted(memory_manager, created.record.id) == 0
        headers = await gate.complete(first, PATH, (), answer)  # leases a slice of the window
        assert headers[1][1].startswith(b'"default";r=999;t=')
        # Then the lease decides at once, each request counted once, one unit each.
        for remaining in (998, 997, 996):
            scope = _scope(created.key)
            decided = gate.decide(scope, PATH)
            assert type(decided) is list
            assert decided[0] == (b"ratelimit-policy", b'"default";q=1000;w=60')
            assert decided[1][1].startswith(b'"default";r=%d;t=' % remaining)
            assert scope["apikey"] == created.record
        assert _admitted(memory_manager, created.record.id) == 4
        # Refusals the lease can tell are booked as every refusal is.
        with pytest.raises(AuthenticationError) as refusal:
            gate.decide(_scope(created.key, "POST"), PATH)
        assert refusal.value.code == "insufficient_scope"
        daily = memory_manager.usage_buffer.pending_daily(created.record.id)
        assert sum(c for (_, o), c in daily.items() if o == "insufficient_scope") == 1
    finally:
        await gate.limiter.aclose()


@pytest.mark.redis
async def test_with_a_redis_limiter_a_spent_window_is_refused_by_either_body_alike(
    memory_manager: KeyManager, lease_prefix: str
) -> None:
    created = await memory_manager.create(name="k", scopes=["contacts:read"])
    gate = _redis_gate(memory_manager, "3/minute", lease_prefix)
    try:
        for _ in range(3):
            await gate.admit(_scope(created.key), PATH)
        for _ in range(3):  # by the lease's word, or Redis' when the lease is spent
            with pytest.raises(AuthenticationError) as refusal:
                await gate.admit(_scope(created.key), PATH)
            assert refusal.value.code == "rate_limited"
            assert (b"ratelimit-policy", b'"default";q=3;w=60') in refusal.value.headers
        daily = memory_manager.usage_buffer.pending_daily(created.record.id)
        assert sum(c for (_, o), c in daily.items() if o == "rate_limited") == 3
        assert _admitted(memory_manager, created.record.id) == 3
    finally:
        await gate.limiter.aclose()


@pytest.mark.redis
async def test_with_a_redis_limiter_several_limits_are_leased_by_one_script_then_decided_at_once(
    memory_manager: KeyManager, lease_prefix: str
) -> None:
    created = await memory_manager.create(
        name="k", scopes=["contacts:read"], rate_limit="burst=1000/second, daily=5000/day"
    )
    gate = _redis_gate(memory_manager, "1000/minute", lease_prefix)
    try:
        for turn in range(3):
            scope = _scope(created.key)
            answer = gate.decide(scope, PATH)
            if turn == 0:
                assert isinstance(answer, Admission)  # one script leases them all
                assert "apikey" not in scope
                await gate.complete(scope, PATH, (), answer)
            else:
                assert type(answer) is list  # every policy's lease holds a unit
            assert scope["apikey"] == created.record
        assert _admitted(memory_manager, created.record.id) == 3
    finally:
        await gate.limiter.aclose()


@pytest.mark.redis
@given(limit=st.integers(1, 40), plan=st.lists(st.integers(0, 1), min_size=1, max_size=120))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_with_redis_limiters_two_processes_gates_admit_exactly_the_limit(
    limit: int, plan: list[int]
) -> None:
    """Two gates (two processes' worth: each its own limiter and leases) on one window:
    exactly min(limit, requests) admitted, whichever call of the core decides each request."""
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    prefix = redis_prefix("gate-prop")

    async def scenario() -> None:
        manager = KeyManager(
            MemoryStore(), hasher=Hasher(pepper="VRmKJHnuTvI2q31x_sfPouLvH-BYMDEC_S3Pigq_fLA")
        )
        gates = [
            _redis_gate(manager, f"{limit}/minute", prefix),
            _redis_gate(manager, f"{limit}/minute", prefix),
        ]
        try:
            created = await manager.create(name="k", scopes=["contacts:read"])
            codes = []
            for index in plan:
                try:
                    await gates[index].admit(_scope(created.key), PATH)
                    codes.append("admitted")
                except AuthenticationError as exc:
                    codes.append(exc.code)
            admitted = codes.count("admitted")
            assert admitted == min(limit, len(plan))
            assert codes.count("rate_limited") == len(plan) - admitted
            assert _admitted(manager, created.record.id) == admitted
        finally:
            for gate in gates:
                await gate.limiter.aclose()
            await manager.aclose()
            await delete_redis_keys(services.REDIS_URL, f"*{prefix}*")

    asyncio.run(scenario())


async def test_a_key_of_an_identity_is_checked_once_by_the_gate_and_its_refusal_is_uncounted(
    memory_manager: KeyManager,
) -> None:
    await memory_manager.create_identity("cust", workspace="default", rate_limit="5/minute")
    created = await memory_manager.create(name="k", scopes=["contacts:read"], identity="cust")
    gate = _gate(memory_manager)
    headers = gate.decide(_scope(created.key), PATH)
    assert type(headers) is list  # held in process: answered by the first call
    assert any(b'"identity.default";r=4' in value for _, value in headers)
    assert _admitted(memory_manager, created.record.id) == 1
    await memory_manager.disable_identity("cust")
    fast_gate, general_gate = _gate(memory_manager), _gate(memory_manager)
    with pytest.raises(AuthenticationError) as fast:
        fast_gate.decide(_scope(created.key), PATH)
    with pytest.raises(AuthenticationError) as general:
        await general_gate.admit(_scope(created.key), PATH)
    with pytest.raises(AuthenticationError) as verified:
        await memory_manager.verify(created.key, record_usage=False)
    assert fast.value.code == general.value.code == verified.value.code == "key_disabled"
    # Refused as `verify` refuses it: the request is not the key's to count.
    assert _admitted(memory_manager, created.record.id) == 1
    daily = memory_manager.usage_buffer.pending_daily(created.record.id)
    assert sum(daily.values()) == 1
