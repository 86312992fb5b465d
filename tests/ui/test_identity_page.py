"""A key's identity on the settings page: a workspace user sees, on each key of an
identity, the identity's id and name, its shared limits and its credits balance, read-only
(CONTRACT 12 and 13). A form that sends `identity` or anything of an identity is refused
with 403 `forbidden_field` and changes nothing.

The HTTP tests run on every store of the table; one test drives the page in Chromium
(the system's `/usr/bin/chromium`, never a downloaded browser) on the memory store.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn

from apikeys import Hasher, KeyManager, MemoryStore
from apikeys.stores import KeyStore
from apikeys.testing import TEST_PEPPER
from apikeys.types import KeyRecord
from tests.pgbouncer import free_port
from tests.ui.test_field_rights import (
    _assert_forbidden,
    _client,
    _create_form,
    _csrf,
    _edit_form,
    _page,
)

CHROMIUM = Path("/usr/bin/chromium")
FORGED = {
    "identity": "cust_other",
    "identity_rate_limit": "1000000/second",
    "identity_credits": "1000000000",
    "identity.credits": "1000000000",
}


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER), webhooks=False) as made:
        yield made


async def _key_of_identity(manager: KeyManager) -> KeyRecord:
    await manager.create_identity(
        "cust_42",
        workspace="acme",
        name="Customer 42",
        rate_limit="burst=10/second, daily=1000/day",
        credits=500,
    )
    await manager.create_identity("cust_other", workspace="acme", credits=10)
    created = await manager.create(
        name="billing", workspace="acme", scopes=["items:read"], identity="cust_42"
    )
    return created.record


async def test_a_key_of_an_identity_shows_the_identitys_limits_and_balance_read_only(
    manager: KeyManager,
) -> None:
    record = await _key_of_identity(manager)
    await manager.create(name="plain", workspace="acme", scopes=["items:read"])
    async with _client(_page(manager)) as client:
        listed = (await client.get("/")).text
        edit = (await client.get(f"/{record.id}/edit")).text
    assert listed.count('class="sub identity"') == 1
    assert 'data-identity-id="cust_42"' in listed
    assert "Customer 42" in listed
    assert "Shared limit burst 10/second" in listed
    assert "Shared limit daily 1000/day" in listed
    assert "500 shared credits left" in listed
    # Never an edit control: no field of the list's or the edit page's forms names it.
    for html in (listed, edit):
        assert 'name="identity' not in html
    assert "cust_other" not in listed  # an identity no key of the list belongs to


@pytest.mark.parametrize("field", sorted(FORGED))
async def test_a_forged_identity_field_on_edit_or_create_is_403_and_changes_nothing(
    manager: KeyManager, field: str
) -> None:
    record = await _key_of_identity(manager)
    identities = await manager.list_identities("acme")
    async with _client(_page(manager)) as client:
        token = _csrf((await client.get(f"/{record.id}/edit")).text)
        edited = await client.post(
            f"/{record.id}/edit", data=_edit_form(record, token, **{field: FORGED[field]})
        )
        created = await client.post("/", data=_create_form(token, **{field: FORGED[field]}))
    _assert_forbidden(edited, field)
    _assert_forbidden(created, field)
    assert await manager.get(record.id) == record
    assert [one.id for one in await manager.list("acme")] == [record.id]
    assert await manager.list_identities("acme") == identities


@pytest.fixture
def served_page() -> Iterator[tuple[str, str]]:
    """The page of a key of an identity, served by uvicorn in a thread on a memory store:
    its base URL and the key's id."""
    port = free_port()
    ready = threading.Event()
    found: dict[str, object] = {}

    async def serve() -> None:
        async with KeyManager(
            MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER), webhooks=False
        ) as manager:
            found["key_id"] = (await _key_of_identity(manager)).id
            server = uvicorn.Server(
                uvicorn.Config(_page(manager), host="127.0.0.1", port=port, log_level="warning")
            )
            found["server"] = server
            task = asyncio.create_task(server.serve())
            while not server.started and not task.done():  # noqa: ASYNC110 - bounded below
                await asyncio.sleep(0.02)
            ready.set()
            await task

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(30)
        yield f"http://127.0.0.1:{port}", str(found["key_id"])
    finally:
        server = found.get("server")
        if isinstance(server, uvicorn.Server):
            server.should_exit = True
        thread.join(30)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs the system's Chromium")
def test_in_a_browser_the_identity_is_shown_and_offers_no_control(
    served_page: tuple[str, str],
) -> None:
    from playwright.sync_api import expect, sync_playwright

    base_url, key_id = served_page
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page()
            page.goto(base_url + "/")
            shown = page.locator(f"#key-{key_id} .identity")
            expect(shown).to_contain_text("cust_42")
            expect(shown).to_contain_text("Customer 42")
            expect(shown).to_contain_text("Shared limit daily 1000/day")
            expect(shown).to_contain_text("500 shared credits left")
            # Read-only: nothing in it can be typed into, chosen or pressed.
            assert shown.locator("input, select, textarea, button, a").count() == 0
            assert page.locator("[name^=identity]").count() == 0
            page.goto(f"{base_url}/{key_id}/edit")
            expect(page.locator("form.create-form")).to_be_visible()
            assert page.locator("[name^=identity]").count() == 0
        finally:
            browser.close()
