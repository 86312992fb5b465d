"""`apikeys webhooks`: the secret printed once, refusals with a clear status."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from click.testing import CliRunner, Result

from apikeys import Hasher, KeyManager
from apikeys.cli import main
from apikeys.types import utcnow
from apikeys.webhooks.admin import add_endpoint


def run(store: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--store", store, "webhooks", *args])


def test_the_secret_is_printed_by_add_and_roll_only(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'keys.db'}"
    added = run(store, "add", "https://example.com/hooks", "--event", "key.revoked", "--json")
    assert added.exit_code == 0, added.output
    endpoint = json.loads(added.output)
    assert endpoint["secret"].startswith("whsec_")
    assert endpoint["events"] == ["key.revoked"]
    listed = run(store, "list", "--json")
    assert json.loads(listed.output) == [{k: v for k, v in endpoint.items() if k != "secret"}]
    assert endpoint["secret"] not in run(store, "list").output
    rolled = run(store, "roll", endpoint["id"], "--json")
    assert rolled.exit_code == 0, rolled.output
    new = json.loads(rolled.output)["secret"]
    assert new.startswith("whsec_")
    assert new != endpoint["secret"]
    assert run(store, "deliveries", "--failed", "--json").output.strip() == "[]"
    removed = run(store, "remove", endpoint["id"])
    assert removed.exit_code == 0
    assert json.loads(run(store, "list", "--json").output) == []


def test_bad_input_is_refused_with_a_clear_status(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'keys.db'}"
    for url in ("ftp://example.com/x", "not a url", "https://user:pw@example.com/"):
        result = run(store, "add", url)
        assert result.exit_code == 2, (url, result.output)
        assert "webhook URL" in result.output
    assert run(store, "add", "https://example.com/", "--event", "key.nothing").exit_code == 2
    # An empty workspace (an unset shell variable, say) is refused, not taken for every one.
    for workspace in ("", " ", "acme\nglobex"):
        result = run(store, "add", "https://example.com/", "--workspace", workspace)
        assert result.exit_code == 2, (workspace, result.output)
        assert "workspace must be" in result.output
    assert json.loads(run(store, "list", "--json").output) == []
    for args in (("remove", "wh_nope"), ("roll", "wh_nope"), ("replay", "msg_nope")):
        result = run(store, *args)
        assert result.exit_code == 1, (args, result.output)
        assert "no " in result.output


def test_a_store_without_webhooks_says_so() -> None:
    result = run("sqlite:///:memory:", "list")
    assert result.exit_code == 1
    assert "keeps no webhooks" in result.output


def test_deliveries_of_one_workspace(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'keys.db'}"

    async def made() -> None:
        async with KeyManager(
            store,
            hasher=Hasher(pepper=b"L8dw49pa41XlgoBNkvoeuME4lzC2vZHAO-p4QCm4Kiw"),
            webhooks=False,
        ) as manager:
            hooks = manager.store.webhooks()
            assert hooks is not None
            await add_endpoint(hooks, "https://example.com/hooks")
            await manager.create(name="ours", workspace="acme", full_access=True)
            for number in range(3):
                await manager.create(name=f"k{number}", workspace="globex", full_access=True)
            await hooks.take(utcnow())

    asyncio.run(made())
    ours = run(store, "deliveries", "--workspace", "acme", "--json")
    assert ours.exit_code == 0, ours.output
    (delivery,) = json.loads(ours.output)
    assert delivery["workspace"] == "acme"
    assert delivery["event"] == "key.created"
    theirs = json.loads(run(store, "deliveries", "--workspace", "globex", "--json").output)
    assert [d["workspace"] for d in theirs] == ["globex"] * 3
    assert len(json.loads(run(store, "deliveries", "--json").output)) == 4
    assert run(store, "deliveries", "--workspace", "nobody").output.strip() == "No deliveries."
