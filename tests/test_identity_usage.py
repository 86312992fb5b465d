"""Daily usage of an identity: the sum of its keys' daily usage, on every store, through
`KeyManager.identity_usage` and `apikeys usage --identity`."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from apikeys import KeyManager, store_from_url
from apikeys.cli import main
from apikeys.errors import IdentityNotFound, InvalidKeyParameters
from apikeys.hashing import Hasher
from apikeys.stores import KeyStore
from apikeys.types import DailyUsage, UsageDelta
from tests.conftest import TEST_PEPPER

TODAY = datetime.now(UTC).date()
YESTERDAY = TODAY - timedelta(days=1)


async def _used(
    store: KeyStore, key_id: str, batch: str, counts: dict[tuple[str, str], int]
) -> None:
    total = sum(counts.values())
    await store.add_usage({key_id: UsageDelta(total, datetime.now(UTC), counts)}, batch_id=batch)


async def test_an_identitys_usage_is_the_sum_of_its_keys_per_day(
    manager: KeyManager, store: KeyStore
) -> None:
    await manager.create_identity("cust_u", workspace="acme")
    first, second, other = [
        (await manager.create(name=name, workspace="acme", full_access=True, **more)).record.id
        for name, more in (("a", {"identity": "cust_u"}), ("b", {"identity": "cust_u"}), ("c", {}))
    ]
    await _used(store, first, "u1", {(YESTERDAY.isoformat(), "admitted"): 2})
    await _used(
        store,
        second,
        "u2",
        {(TODAY.isoformat(), "admitted"): 3, (TODAY.isoformat(), "rate_limited"): 1},
    )
    await _used(store, other, "u3", {(TODAY.isoformat(), "admitted"): 50})  # not the identity's
    await manager.revoke(second)  # a revoked key's requests are still the identity's
    history = await manager.identity_usage("cust_u", days=2)
    assert history == [
        DailyUsage(YESTERDAY, admitted=2),
        DailyUsage(TODAY, admitted=3, refused={"rate_limited": 1}),
    ]
    assert [day.day for day in await manager.identity_usage("cust_u", days=5)][-1] == TODAY
    await manager.update(first, identity=None)  # a key moved out takes its history along
    assert await manager.identity_usage("cust_u", days=2) == [
        DailyUsage(YESTERDAY),
        DailyUsage(TODAY, admitted=3, refused={"rate_limited": 1}),
    ]


async def test_an_unknown_identity_or_a_bad_range_is_refused(manager: KeyManager) -> None:
    with pytest.raises(IdentityNotFound):
        await manager.identity_usage("cust_404")
    await manager.create_identity("cust_u", workspace="acme")
    for days in (0, 3661):
        with pytest.raises(InvalidKeyParameters):
            await manager.identity_usage("cust_u", days=days)
    with pytest.raises(InvalidKeyParameters):
        await manager.identity_usage("not/an/id")


@pytest.mark.sqlite
def test_cli_usage_identity_prints_the_sum_and_refuses_what_it_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APIKEYS_PEPPER", TEST_PEPPER)
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)
    url = f"sqlite:///{tmp_path / 'cli.db'}"

    async def setup() -> str:
        store = store_from_url(url)
        async with KeyManager(store, hasher=Hasher(TEST_PEPPER)) as manager:
            await manager.create_identity("cust_u", workspace="acme", name="Customer U")
            key_id = (
                await manager.create(
                    name="a", workspace="acme", full_access=True, identity="cust_u"
                )
            ).record.id
            await _used(store, key_id, "c1", {(TODAY.isoformat(), "admitted"): 4})
        return key_id

    key_id = asyncio.run(setup())
    run = CliRunner().invoke
    shown = run(main, ["--store", url, "usage", "--identity", "cust_u", "--days", "2"])
    assert shown.exit_code == 0, shown.output
    assert "Identity cust_u ('Customer U'), all its keys, the last 2 UTC days:" in shown.output
    assert "Total: 4 admitted, 0 refused." in shown.output
    as_json = run(main, ["--store", url, "usage", "--identity", "cust_u", "--json"])
    body = json.loads(as_json.output)
    assert (body["identity"], body["admitted"], len(body["days"])) == ("cust_u", 4, 30)
    unknown = run(main, ["--store", url, "usage", "--identity", "cust_404"])
    assert unknown.exit_code == 1
    for args in (
        ["usage"],
        ["usage", key_id, "--identity", "cust_u"],
        ["usage", "--identity", "a/b"],
    ):
        refused = run(main, ["--store", url, *args])
        assert refused.exit_code == 2, refused.output
    assert run(main, ["--store", url, "usage", key_id]).exit_code == 0  # a key's, as before
