"""Metrics (OpenTelemetry, read with the SDK's in-memory reader) and the on_event hook."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, Hasher, KeyManager, MemoryStore
from apikeys.keys import parse_key
from apikeys.telemetry import TelemetryEvent
from tests.conftest import TEST_PEPPER


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """{instrument: [(attributes, value or histogram count)]} of what was recorded."""
    found: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "value", None)
                    if value is None:
                        value = point.count  # a histogram
                    found.setdefault(metric.name, []).append((dict(point.attributes), value))
    return found


async def ok(request: object) -> PlainTextResponse:
    return PlainTextResponse("ok")


def app_for(manager: KeyManager) -> APIKeyMiddleware:
    return APIKeyMiddleware(
        Starlette(routes=[Route("/api/x", ok)]),
        manager=manager,
        scopes={"GET /api/x": "x:read"},
        protect="/api/",
        rate_limit="2/minute",
    )


async def test_metrics_count_verifications_limiter_decisions_and_cache_lookups() -> None:
    reader = InMemoryMetricReader()
    events: list[TelemetryEvent] = []
    manager = KeyManager(
        MemoryStore(),
        hasher=Hasher(pepper=TEST_PEPPER),
        metrics=MeterProvider(metric_readers=[reader]),
        on_event=events.append,
    )
    async with manager:
        created = await manager.create(name="n", scopes=["x:read"], actor="ops")
        transport = httpx.ASGITransport(app=app_for(manager))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            good = {"Authorization": f"Bearer {created.key}"}
            statuses = [(await http.get("/api/x", headers=good)).status_code for _ in range(3)]
            bad = (await http.get("/api/x", headers={"Authorization": "Bearer nope"})).status_code
        await manager.revoke(created.record.id, actor="ops")
    assert statuses == [200, 200, 429]
    assert bad == 401

    found = points(reader)
    verifications = {attrs["outcome"]: value for attrs, value in found["apikeys.verifications"]}
    assert verifications == {"ok": 3, "malformed_api_key": 1}
    assert all(attrs["store"] == "memory" for attrs, _ in found["apikeys.verifications"])
    durations = {attrs["outcome"]: count for attrs, count in found["apikeys.verification.duration"]}
    assert durations == {"ok": 3, "malformed_api_key": 1}
    decisions = {attrs["decision"]: value for attrs, value in found["apikeys.limiter.decisions"]}
    assert decisions == {"allowed": 2, "rate_limited": 1}
    # Low cardinality: no key id in any attribute.
    key_id = created.record.id
    assert key_id not in str(found)
    assert parse_key(created.key).secret not in str(found)

    kinds = [(event.kind, event.outcome) for event in events]
    assert kinds[0] == ("key_changed", "created")
    assert kinds.count(("verification", "ok")) == 3
    assert ("verification", "malformed_api_key") in kinds
    assert ("limited", "rate_limited") in kinds
    assert kinds[-1] == ("key_changed", "revoked")
    assert events[-1].audit is not None
    assert events[-1].audit.actor == "ops"
    assert all(created.key not in repr(event) for event in events)


async def test_a_failing_hook_is_logged_and_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(event: TelemetryEvent) -> None:
        raise RuntimeError("webhook down")

    async with KeyManager(
        MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER), on_event=broken
    ) as manager:
        created = await manager.create(name="n", full_access=True)
        assert (await manager.verify(created.key)).id == created.record.id
    assert "on_event hook failed" in caplog.text


@pytest.mark.postgres
async def test_the_cache_reports_hits_and_misses(postgres_url: str) -> None:
    reader = InMemoryMetricReader()
    import uuid

    from apikeys import store_from_url

    store = store_from_url(postgres_url, table_name=f"apikeys_keys_{uuid.uuid4().hex[:10]}")
    manager = KeyManager(
        store, hasher=Hasher(pepper=TEST_PEPPER), metrics=MeterProvider(metric_readers=[reader])
    )
    verified = 0
    async with manager:
        created = await manager.create(name="n", full_access=True)
        # The cache serves once its channel has proved it fresh (a probe, milliseconds).
        deadline = asyncio.get_running_loop().time() + 5
        while asyncio.get_running_loop().time() < deadline:
            await manager.verify(created.key)
            verified += 1
            found = points(reader).get("apikeys.cache.lookups", [])
            if any(attrs["result"] == "hit" for attrs, _ in found):
                break
            await asyncio.sleep(0.02)
        for _ in range(5):
            await manager.verify(created.key)
    lookups = {attrs["result"]: value for attrs, value in points(reader)["apikeys.cache.lookups"]}
    assert lookups["miss"] >= 1
    assert lookups["hit"] >= 5
    assert lookups["hit"] + lookups["miss"] == verified + 5


def test_without_opentelemetry_metrics_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from apikeys import ConfigurationError

    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'apikeys\[otel\]'"):
        KeyManager(MemoryStore(), metrics=True)


def test_unused_telemetry_is_inactive() -> None:
    manager = KeyManager(MemoryStore())
    assert manager.telemetry.active is False


class FlakyStore(MemoryStore):
    """A memory store whose usage writes fail."""

    async def add_usage(self, usage: Any, *, batch_id: str) -> None:
        raise ConnectionError("the store is away")


async def test_failed_usage_flushes_are_counted_and_told() -> None:
    reader = InMemoryMetricReader()
    events: list[TelemetryEvent] = []
    manager = KeyManager(
        FlakyStore(),
        hasher=Hasher(pepper=TEST_PEPPER),
        usage_flush_interval=0.01,
        metrics=MeterProvider(metric_readers=[reader]),
        on_event=events.append,
    )
    created = await manager.create(name="n", full_access=True)
    await manager.verify(created.key)
    for _ in range(200):
        if any(event.kind == "usage_flush_failed" for event in events):
            break
        await asyncio.sleep(0.01)
    failures = points(reader)["apikeys.usage.flush_failures"]
    assert failures[0][0] == {"store": "flaky"}
    assert failures[0][1] >= 1
    assert any(e.kind == "usage_flush_failed" and e.outcome == "ConnectionError" for e in events)
    manager.usage_buffer._open.clear()  # nothing to write: let it close
    manager.usage_buffer._queue.clear()
    await manager.aclose()
