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
        "legacy_scheme": 0,
    }


async def test_the_middleware_counts_each_request_as_admitted_or_refused_by_code(
    manager: KeyManager,
) -> None:
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from apikeys import APIKeyMiddleware

    async def ok(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = APIKeyMiddleware(
        Starlette(routes=[Route("/api/read", ok), Route("/api/write", ok, methods=["POST"])]),
        manager=manager,
        scopes={"GET /api/read": "items:read", "POST /api/write": "items:write"},
        protect="/api/",
        rate_limit="3/minute",
    )
    created = await manager.create(name="n", scopes=["items:read"])
    fenced = await manager.create(name="f", scopes=["items:read"], allowed_ips=["10.0.0.0/8"])
    headers = {"Authorization": f"Bearer {created.key}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        statuses = [(await http.get("/api/read", headers=headers)).status_code for _ in range(2)]
        statuses.append((await http.post("/api/write", headers=headers)).status_code)
        statuses.append((await http.get("/api/read", headers=headers)).status_code)
        statuses.append(
            (await http.get("/api/read", headers={"Authorization": "Bearer x"})).status_code
        )
        fenced_status = (
            await http.get("/api/read", headers={"Authorization": f"Bearer {fenced.key}"})
        ).status_code
    assert statuses == [200, 200, 403, 429, 401]
    assert fenced_status == 403

    # Before and after the flush: the same history (unwritten counts are included).
    for _ in range(2):
        [today] = await manager.usage(created.record.id, days=1)
        assert today == DailyUsage(
            TODAY, admitted=2, refused={"insufficient_scope": 1, "rate_limited": 1}
        )
        [fenced_today] = await manager.usage(fenced.record.id, days=1)
        assert fenced_today.refused == {"ip_not_allowed": 1}
        assert fenced_today.admitted == 0
        await manager.flush()
    week = await manager.usage(created.record.id, days=7)
    assert [day.day for day in week] == [TODAY - timedelta(days=n) for n in range(6, -1, -1)]
    assert sum(day.total for day in week) == 4
    assert (await manager.get(created.record.id)).request_count == 4
