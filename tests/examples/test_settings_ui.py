"""The settings UI of the example service, in a real browser.

The service runs as a user runs it (`python -m uvicorn examples.contacts_service.app:app`,
with `EXAMPLE_ADMIN_EMAIL` and `EXAMPLE_ADMIN_PASSWORD`), and Chromium (the system's
`/usr/bin/chromium`; these tests never download a browser) is driven with Playwright's
sync API. Keys made in the browser are then used against the API over HTTP, as the
integration that receives them would.

Screenshots of the settings page (desktop 1280x800, phone 390x844) are saved under
`test-artifacts/` for review.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import uuid
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from examples.contacts_service.settings import Settings
from playwright.sync_api import (
    Browser,
    BrowserContext,
    Page,
    ViewportSize,
    expect,
    sync_playwright,
)

from apikeys import Hasher, KeyManager, parse_key, store_from_url
from apikeys.stores import MemoryStore
from apikeys.types import KeyRecord, StoredKey, UsageDelta
from apikeys.ui import Reveal, RevealStore
from apikeys.ui.forms import parse_expiry, relative
from tests import services
from tests.examples.conftest import PEPPER, REPO, service_env, start_service, stop_service

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO / "test-artifacts"
KEYS = "/settings/integrations/api-keys"
LIST = KEYS + "/"
PAGE_COOKIE = "apikeys_page"
EMAIL = "Admin@UI-Test.example"
PASSWORD = "correct horse battery staple"
WORKSPACE = "ui-test"
COOKIE = "contacts_session"
KEY_RE = re.compile(r"ak_live_[0-9A-Za-z]{12}_[0-9A-Za-z]{38}")
T = TypeVar("T")
DESKTOP: ViewportSize = {"width": 1280, "height": 800}
PHONE: ViewportSize = {"width": 390, "height": 844}


def run_async(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `main()` to completion in a thread of its own.

    Playwright's sync API keeps an event loop running in the test's thread, so
    `asyncio.run` cannot be called there.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(main())).result()


@dataclass
class UIService:
    base_url: str
    store_url: str
    zapier_id: str = ""

    def manager(self) -> KeyManager:
        return KeyManager(store_from_url(self.store_url), hasher=Hasher(pepper=PEPPER))

    def create_key(self, workspace: str, name: str = "elsewhere") -> str:
        async def create() -> str:
            async with self.manager() as manager:
                created = await manager.create(
                    name=name, workspace=workspace, scopes=["contacts:read"]
                )
            return created.record.id

        return run_async(create)

    def issue(self, workspace: str, name: str, **options: Any) -> str:
        """A key the operator makes (any field): the key itself."""

        async def create() -> str:
            async with self.manager() as manager:
                created = await manager.create(name=name, workspace=workspace, **options)
            return created.key

        return run_async(create)

    def update(self, key_id: str, **changes: Any) -> KeyRecord:
        """What the operator changes, with the Python API."""

        async def update() -> KeyRecord:
            async with self.manager() as manager:
                return await manager.update(key_id, **changes)

        return run_async(update)

    def status(self, key_id: str) -> str:
        async def get() -> str:
            async with self.manager() as manager:
                return (await manager.get(key_id)).status

        return run_async(get)

    def key_count(self, workspace: str) -> int:
        async def count() -> int:
            async with self.manager() as manager:
                return len(await manager.list(workspace))

        return run_async(count)

    def api(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=10
        )


def _require_chromium() -> None:
    if CHROMIUM.exists():
        return
    message = (
        f"Chromium is not installed at {CHROMIUM}; install it with `apt-get install chromium` "
        "(these tests drive the system's Chromium and never download a browser)"
    )
    if services.REQUIRE_SERVICES:
        pytest.fail(message + " [APIKEYS_REQUIRE_SERVICES=1]")
    pytest.skip(message)


@pytest.fixture(scope="module")
def ui_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UIService]:
    tmp = tmp_path_factory.mktemp("settings-ui")
    store_url = f"sqlite:///{tmp / 'apikeys.db'}"
    env = service_env(
        APIKEYS_STORE_URL=store_url,
        EXAMPLE_DATABASE_URL=f"sqlite:///{tmp / 'example.db'}",
        EXAMPLE_ADMIN_EMAIL=EMAIL,
        EXAMPLE_ADMIN_PASSWORD=PASSWORD,
        EXAMPLE_WORKSPACE=WORKSPACE,
        EXAMPLE_SESSION_SECRET="settings-ui-test-session-secret",
        # tests/examples/test_settings_webhooks.py's receiver listens on 127.0.0.1.
        APIKEYS_WEBHOOKS_ALLOW_PRIVATE="1",
    )
    log = tmp / "service.log"
    # Served as behind a proxy at 127.0.0.1, named as a deployment names it: uvicorn then
    # believes that proxy's X-Forwarded-Proto (and only that proxy's).
    process, base_url = start_service(env, log, "--forwarded-allow-ips", "127.0.0.1")
    try:
        yield UIService(base_url, store_url)
    finally:
        stop_service(process, log)
    output = log.read_text()
    assert PASSWORD not in output  # the password is never logged


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    _require_chromium()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=LAUNCH_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def context(browser: Browser, ui_service: UIService) -> Iterator[BrowserContext]:
    context = browser.new_context(base_url=ui_service.base_url, viewport=DESKTOP)
    context.set_default_timeout(10_000)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture
def page(context: BrowserContext) -> Page:
    return context.new_page()


def log_in(page: Page, email: str = EMAIL, password: str = PASSWORD) -> None:
    page.goto("/login")
    page.fill("#email", email)
    page.fill("#password", password)
    page.click("button:text('Log in')")


def create_key(page: Page, name: str, scopes: list[str] | None = None, **fields: str) -> str:
    """Fill in and send the create form; return the key the page shows once."""
    page.goto(KEYS)
    page.fill("#name", name)
    if scopes is None:
        page.check("input[name=access][value=full]")
    else:
        page.check("input[name=access][value=restricted]")
        for scope in scopes:
            page.check(f"input[name=scopes][value='{scope}']")
    for field, value in fields.items():
        page.fill(f"#{field}", value)
    page.click("button:text('Create key')")
    expect(page.locator("#new-key")).to_be_visible()
    key = page.input_value("#new-key-value")
    assert KEY_RE.fullmatch(key), key
    return key


def row(page: Page, key: str) -> Any:
    return page.locator(f"tr[data-key-id='{parse_key(key).id}']")


def csrf(page: Page) -> str:
    return page.locator("input[name=csrf_token]").first.input_value()


def session_cookie(context: BrowserContext, name: str = COOKIE) -> dict[str, Any]:
    cookies = [c for c in context.cookies() if c["name"] == name]
    assert len(cookies) == 1, cookies
    return dict(cookies[0])


def session_data(context: BrowserContext, name: str = COOKIE) -> dict[str, Any]:
    """What a signed session cookie holds: readable by anyone who has the cookie."""
    payload = session_cookie(context, name)["value"].split(".", 1)[0]
    data: dict[str, Any] = json.loads(base64.b64decode(payload + "=" * (-len(payload) % 4)))
    return data


def assert_problem(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["code"] == code


def assert_key_absent(page: Page, *keys: str) -> None:
    html = page.content()
    for key in keys:
        assert key not in html
        assert parse_key(key).secret not in html


# -- the whole life of a key ------------------------------------------------------------------


def test_a_key_made_in_the_browser_works_then_is_disabled_enabled_rolled_and_revoked(
    ui_service: UIService, context: BrowserContext, page: Page
) -> None:
    page.goto(KEYS)
    expect(page).to_have_url(re.compile(r"/login\?next="))
    log_in(page)
    expect(page).to_have_url(re.compile(LIST + "$"))
    expect(page.locator("h1")).to_have_text("API keys")

    # Invalid input is explained, and creates nothing.
    before = ui_service.key_count(WORKSPACE)
    page.fill("#name", "Broken")
    page.check("input[name=access][value=restricted]")
    page.check("input[name=scopes][value='contacts:read']")
    page.fill("#expires", "soon")
    page.click("button:text('Create key')")
    expect(page.locator("#form-errors")).to_contain_text("The key was not created")
    expect(page.locator("#expires-error")).to_contain_text("30d")
    expect(page.locator("#name")).to_have_value("Broken")  # what was typed is kept
    page.check("input[name=access][value=restricted]")
    page.uncheck("input[name=scopes][value='contacts:read']")
    page.fill("#expires", "")
    page.click("button:text('Create key')")
    expect(page.locator("#scopes-error")).to_contain_text("at least one scope")
    assert ui_service.key_count(WORKSPACE) == before

    # The rate limit is the operator's: not offered to the workspace user.
    expect(page.locator("#rate_limit")).to_have_count(0)
    expect(page.locator("#operator-fields")).to_contain_text("set by the operator")

    # Created: shown once, with a copy button and a plain warning.
    key = create_key(page, "Zapier", ["contacts:read"], expires="30d")
    ui_service.update(parse_key(key).id, rate_limit="50/minute")  # as the operator sets it
    expect(page.locator("#new-key")).to_contain_text("shown only once")
    expect(page.locator("#new-key")).to_contain_text("will not be shown again")
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.click("button[data-copy]")
    expect(page.locator("button[data-copy]")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == key
    key_row = row(page, key)
    expect(key_row.locator(".masked")).to_have_text(f"ak_live_{parse_key(key).id}_…")
    expect(key_row.locator(".cell-access")).to_contain_text("contacts:read")
    expect(key_row.locator(".cell-status")).to_contain_text("active")
    expect(key_row.locator(".cell-status")).to_contain_text("expires in 29 days")
    expect(key_row.locator(".cell-last-used")).to_have_text("never")
    expect(key_row.locator(".cell-requests")).to_have_text("0")

    # The key works, within its scopes.
    with ui_service.api(key) as api:
        assert api.get("/api/v1/contacts").status_code == 200
        assert_problem(api.post("/api/v1/contacts", json={"name": "A"}), 403, "insufficient_scope")

    # A reload never shows the key again; the list shows the requests it made, and the
    # operator's rate limit.
    page.reload()
    expect(row(page, key).locator(".cell-access")).to_contain_text("50/minute")
    expect(page.locator("#new-key")).to_have_count(0)
    assert_key_absent(page, key)
    key_row = row(page, key)
    expect(key_row.locator(".cell-requests")).to_have_text("2")
    last_used = key_row.locator(".cell-last-used time")
    expect(last_used).to_have_text(re.compile(r"just now|\d+ seconds? ago"))
    expect(last_used).to_have_attribute(
        "title", re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$")
    )

    # Disabled: 401 key_disabled; enabled: it works again.
    key_row.get_by_role("button", name="Disable").click()
    expect(page.locator("#notice")).to_contain_text("disabled")
    expect(row(page, key).locator(".badge")).to_have_text("disabled")
    with ui_service.api(key) as api:
        assert_problem(api.get("/api/v1/contacts"), 401, "key_disabled")
    row(page, key).get_by_role("button", name="Enable").click()
    expect(row(page, key).locator(".badge")).to_have_text("active")
    with ui_service.api(key) as api:
        assert api.get("/api/v1/contacts").status_code == 200

    # Rolled: the new key is shown once and works; the old one works during its grace.
    row(page, key).get_by_role("link", name="Roll").click()
    expect(page.locator("h1")).to_contain_text(
        f"Roll key «Zapier» (ak_live_{parse_key(key).id}_…)?"
    )
    expect(page.locator("#grace")).to_have_value("24h")
    expect(page.locator(".lifetime")).to_contain_text("The new key expires when this one does")
    page.click("button:text('Roll key')")
    expect(page.locator("#new-key")).to_contain_text("rolled")
    expect(page.locator(".reveal-record")).to_contain_text("contacts:read · expires ")
    new_key = page.input_value("#new-key-value")
    assert KEY_RE.fullmatch(new_key)
    assert new_key != key
    expect(page.locator("#grace-note")).to_contain_text("keeps working until")
    expect(page.locator("#grace-note")).to_contain_text("in 23 hours")
    assert page.content().count(new_key) == 1
    assert key not in page.content()
    with ui_service.api(new_key) as api:
        assert api.get("/api/v1/contacts").status_code == 200
    with ui_service.api(key) as api:
        assert api.get("/api/v1/contacts").status_code == 200
    page.reload()
    assert_key_absent(page, key, new_key)
    expect(row(page, new_key).locator(".cell-access")).to_contain_text("50/minute")

    # Revoked, through a confirmation that names the key: 401 key_revoked.
    row(page, new_key).get_by_role("link", name="Revoke").click()
    expect(page).to_have_url(re.compile(f"{KEYS}/{parse_key(new_key).id}/revoke$"))
    expect(page.locator("h1")).to_have_text(
        f"Revoke key «Zapier» (ak_live_{parse_key(new_key).id}_…)?"
    )
    assert_key_absent(page, key, new_key)
    page.get_by_role("button", name="Revoke key «Zapier»").click()
    expect(page.locator("#notice")).to_contain_text("revoked")
    # Kept for audit, but folded out of the list of keys in use.
    expect(row(page, new_key)).to_have_count(0)
    page.get_by_role("link", name="show revoked keys").click()
    expect(row(page, new_key).locator(".badge")).to_have_text("revoked")
    expect(row(page, new_key).locator(".cell-actions")).to_have_text("")
    page.get_by_role("link", name="Active").click()
    expect(page.locator(".key-row .badge")).not_to_contain_text(["revoked"])
    with ui_service.api(new_key) as api:
        assert_problem(api.get("/api/v1/contacts"), 401, "key_revoked")

    # Never again in any page, nor in the (readable) session cookie.
    for path in (KEYS, f"{KEYS}/{parse_key(key).id}/roll", f"{KEYS}/{parse_key(key).id}/revoke"):
        page.goto(path)
        assert_key_absent(page, key, new_key)
    data = session_data(context)
    assert set(data) <= {"sid", "csrf", "notice"}
    # The keys page keeps its own cookie, HttpOnly too, bound to the user, never a key.
    page_cookie = session_cookie(context, PAGE_COOKIE)
    assert page_cookie["httpOnly"] is True
    assert page_cookie["sameSite"] == "Lax"
    page_data = session_data(context, PAGE_COOKIE)
    assert set(page_data) <= {"uid", "csrf", "notice", "reveal"}
    for secret in (key, new_key):
        assert parse_key(secret).secret not in json.dumps(data)
        assert parse_key(secret).secret not in json.dumps(page_data)


def test_a_key_edited_in_the_browser_is_narrowed_on_its_next_request(
    ui_service: UIService, page: Page
) -> None:
    log_in(page)
    key = create_key(page, "Sync", ["contacts:read", "contacts:write"], expires="30d")
    key_id = parse_key(key).id
    with ui_service.api(key) as api:
        assert api.post("/api/v1/contacts", json={"name": "Before"}).status_code == 201
    page.goto(LIST)
    row(page, key).get_by_role("link", name="Edit").click()
    expect(page).to_have_url(re.compile(f"{KEYS}/{key_id}/edit$"))
    expect(page.locator("h1")).to_have_text(f"Edit key «Sync» (ak_live_{key_id}_…)")
    expect(page.locator("#name")).to_have_value("Sync")
    expect(page.locator("input[name=scopes][value='contacts:write']")).to_be_checked()
    expires_shown = page.input_value("#expires")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", expires_shown)

    # The rate limit is the operator's: shown, never offered.
    expect(page.locator("#rate_limit")).to_have_count(0)
    expect(page.locator("#rate_limit-field")).to_contain_text("Set by the operator")

    # A bad value is explained and changes nothing.
    page.fill("#expires", "soon")
    page.click("button:text('Save changes')")
    expect(page.locator("#form-errors")).to_contain_text("The key was not changed")
    with ui_service.api(key) as api:
        assert api.post("/api/v1/contacts", json={"name": "Still"}).status_code == 201

    # A later expiry, or a rate limit sent anyway, is refused (403) and changes nothing.
    token = csrf(page)
    form = {"csrf_token": token, "name": "Sync", "access": "restricted", "scopes": "contacts:read"}
    for forged in ({"expires": "60d"}, {"expires": expires_shown, "rate_limit": "1000/second"}):
        posted = page.context.request.post(f"{KEYS}/{key_id}/edit", form={**form, **forged})
        assert posted.status == 403
        assert "forbidden_field" in posted.text()
    with ui_service.api(key) as api:
        assert api.post("/api/v1/contacts", json={"name": "Still"}).status_code == 201

    page.fill("#name", "Read-only sync")
    page.fill("#expires", expires_shown)
    page.uncheck("input[name=scopes][value='contacts:write']")
    page.click("button:text('Save changes')")
    expect(page.locator("#notice")).to_contain_text("is saved")
    edited = row(page, key)
    expect(edited.locator(".key-label")).to_have_text("Read-only sync")
    expect(edited.locator(".cell-access")).not_to_contain_text("contacts:write")
    expect(edited.locator(".cell-status")).to_contain_text("expires in 29 days")  # kept
    # The very next request sees the narrower key; the key itself is the same.
    with ui_service.api(key) as api:
        assert_problem(api.post("/api/v1/contacts", json={"name": "A"}), 403, "insufficient_scope")
        assert api.get("/api/v1/contacts").status_code == 200

    # A revoked key cannot be edited: 409, and nothing changes.
    page.goto(f"{KEYS}/{key_id}/revoke")
    token = csrf(page)
    page.get_by_role("button", name="Revoke key «Read-only sync»").click()
    shown = page.goto(f"{KEYS}/{key_id}/edit")
    assert shown is not None
    assert shown.status == 409
    posted = page.context.request.post(
        f"{KEYS}/{key_id}/edit",
        form={"csrf_token": token, "name": "Revived", "access": "full", "expires": ""},
    )
    assert posted.status == 409
    assert "cannot be edited" in posted.text()
    assert ui_service.status(key_id) == "revoked"


def test_a_rolled_key_links_to_its_successor_and_offers_no_roll_or_disable(
    ui_service: UIService, page: Page
) -> None:
    log_in(page)
    key = create_key(page, "Webhook", ["campaigns:trigger"])
    old_id = parse_key(key).id
    page.goto(f"{KEYS}/{old_id}/roll")
    page.click("button:text('Roll key')")
    new_key = page.input_value("#new-key-value")
    new_id = parse_key(new_key).id
    page.goto(LIST)
    old_row, new_row = row(page, key), row(page, new_key)
    expect(old_row.locator(".replaced-by")).to_contain_text("Replaced by")
    expect(old_row.locator(".replaced-by a")).to_have_attribute("href", f"#key-{new_id}")
    expect(new_row.locator(".replaces a")).to_have_attribute("href", f"#key-{old_id}")
    expect(old_row.get_by_role("link", name="Roll")).to_have_count(0)
    expect(old_row.get_by_role("button", name="Disable")).to_have_count(0)
    expect(old_row.get_by_role("link", name="Revoke")).to_have_count(1)
    expect(new_row.get_by_role("link", name="Roll")).to_have_count(1)
    expect(new_row.get_by_role("button", name="Disable")).to_have_count(1)
    # Asked for anyway: refused, and the old key goes on working through its grace.
    token = csrf(page)
    for action in ("roll", "disable"):
        posted = page.context.request.post(
            f"{KEYS}/{old_id}/{action}", form={"csrf_token": token, "grace": "0"}
        )
        assert posted.status == 409, action
    shown = page.goto(f"{KEYS}/{old_id}/roll")
    assert shown is not None
    assert shown.status == 409
    assert ui_service.status(old_id) == "active"
    with ui_service.api(key) as api:
        assert api.post("/api/v1/campaigns/1/trigger").status_code != 401


def test_if_login_fails_then_the_same_generic_error_whether_or_not_the_user_exists(
    ui_service: UIService, context: BrowserContext, page: Page
) -> None:
    messages = []
    for email, password in ((EMAIL, "wrong password"), ("nobody@ui-test.example", PASSWORD)):
        log_in(page, email, password)
        expect(page.locator("#login-error")).to_be_visible()
        messages.append(page.locator("#login-error").inner_text())
        expect(page.locator("#password")).to_have_value("")
    assert messages == ["Incorrect e-mail address or password."] * 2
    assert "sid" not in session_data(context)
    page.goto(KEYS)
    expect(page).to_have_url(re.compile("/login"))


def test_session_cookie_is_httponly_samesite_lax_and_logout_ends_the_session(
    ui_service: UIService, context: BrowserContext, page: Page
) -> None:
    log_in(page)
    expect(page).to_have_url(re.compile(LIST + "$"))
    cookie = session_cookie(context)
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Lax"
    assert cookie["secure"] is False  # served over plain http here
    assert page.evaluate("document.cookie") == ""  # out of reach of scripts

    # Over https (here: from the proxy at 127.0.0.1 the service names) it is also Secure.
    plain = httpx.get(f"{ui_service.base_url}/login").headers["set-cookie"].lower()
    https = httpx.get(
        f"{ui_service.base_url}/login", headers={"X-Forwarded-Proto": "https"}
    ).headers["set-cookie"]
    assert {"httponly", "samesite=lax"} <= {part.strip() for part in plain.split(";")}
    assert "secure" not in plain
    assert "secure" in {part.strip() for part in https.lower().split(";")}

    page.get_by_role("link", name="Log out").click()
    page.get_by_role("button", name="Log out").click()
    expect(page).to_have_url(re.compile("/login$"))
    expect(page.locator("[role=status]")).to_have_text("You have logged out.")
    page.goto(KEYS)
    expect(page).to_have_url(re.compile("/login"))

    # The old cookie, replayed, no longer opens a session: logout ended it on the server.
    with httpx.Client(base_url=ui_service.base_url, cookies={COOKIE: cookie["value"]}) as http:
        response = http.get(LIST)
    assert response.status_code == 303
    assert response.headers["location"].startswith("/login")


# -- refusals ---------------------------------------------------------------------------------


def test_if_login_fails_repeatedly_then_it_is_throttled_even_with_the_right_password(
    ui_service: UIService,
) -> None:
    email = f"throttled-{uuid.uuid4().hex[:8]}@ui-test.example"
    with httpx.Client(base_url=ui_service.base_url) as http:
        token = re.search(r'name="csrf_token" value="([^"]+)"', http.get("/login").text)
        assert token is not None
        form = {"csrf_token": token.group(1), "email": email, "password": "guess"}
        statuses = [http.post("/login", data=form).status_code for _ in range(6)]
        assert statuses == [400] * 5 + [429]
        refused = http.post("/login", data=form)
        assert int(refused.headers["retry-after"]) >= 1
        assert "Too many failed attempts" in refused.text
        # Another address from the same client is not locked out by this one.
        other = http.post("/login", data={**form, "email": EMAIL, "password": PASSWORD})
        assert other.status_code == 303


def test_if_wrong_logins_arrive_all_at_once_then_only_the_allowed_few_are_checked(
    ui_service: UIService,
) -> None:
    # Security review, finding 4: the throttle was checked before the password hash (in a
    # thread) and the failure recorded after it, so 20 concurrent guesses were all checked.
    email = f"concurrent-{uuid.uuid4().hex[:8]}@ui-test.example"
    with httpx.Client(base_url=ui_service.base_url) as http:
        token = re.search(r'name="csrf_token" value="([^"]+)"', http.get("/login").text)
        assert token is not None
        form = {"csrf_token": token.group(1), "email": email, "password": "guess"}
        with ThreadPoolExecutor(max_workers=20) as pool:
            statuses = list(
                pool.map(lambda _: http.post("/login", data=form).status_code, range(20))
            )
    assert sorted(set(statuses)) == [400, 429]
    assert statuses.count(400) == 5  # per_email: only five reached the password check


def test_if_form_posted_without_or_with_a_wrong_csrf_token_then_403_and_nothing_changes(
    ui_service: UIService, context: BrowserContext, page: Page
) -> None:
    log_in(page)
    page.goto(KEYS)
    token = csrf(page)
    before = ui_service.key_count(WORKSPACE)
    form: dict[str, str | float | bool] = {"name": "forged", "access": "full"}
    for sent in (form, {**form, "csrf_token": "forged-token"}, {**form, "csrf_token": ""}):
        response = context.request.post(LIST, form=sent, max_redirects=0)
        assert response.status == 403
        assert "Form expired" in response.text()
    # The same refusal from outside the browser, with its session cookie.
    cookie = session_cookie(context)["value"]
    with httpx.Client(base_url=ui_service.base_url, cookies={COOKIE: cookie}) as http:
        assert http.post(LIST, data=form).status_code == 403
        assert http.post("/logout", data={}).status_code == 403
        key_id = ui_service.create_key(WORKSPACE, "csrf target")
        assert http.post(f"{KEYS}/{key_id}/revoke", data={"csrf_token": "x"}).status_code == 403
    assert ui_service.status(key_id) == "active"
    assert ui_service.key_count(WORKSPACE) == before + 1
    # With the page's token the same form goes through; the user is still logged in.
    response = context.request.post(LIST, form={**form, "csrf_token": token}, max_redirects=0)
    assert response.status == 303
    assert ui_service.key_count(WORKSPACE) == before + 2


def test_if_key_id_unknown_or_of_another_workspace_then_404_page_and_nothing_changes(
    ui_service: UIService, context: BrowserContext, page: Page
) -> None:
    foreign = ui_service.create_key(f"other-{uuid.uuid4().hex[:8]}")
    log_in(page)
    page.goto(KEYS)
    token = csrf(page)
    assert page.locator(f"tr[data-key-id='{foreign}']").count() == 0
    for key_id in (foreign, "AAAAAAAAAAAA", "not-an-id"):
        for action in ("revoke", "roll"):
            shown = page.goto(f"{KEYS}/{key_id}/{action}")
            assert shown is not None
            assert shown.status == 404
            expect(page.locator("h1")).to_have_text("No such API key")
        for action in ("disable", "enable", "revoke", "roll"):
            posted = context.request.post(
                f"{KEYS}/{key_id}/{action}", form={"csrf_token": token, "grace": "0"}
            )
            assert posted.status == 404
            assert "No such API key" in posted.text()
    assert ui_service.status(foreign) == "active"


def test_if_not_logged_in_then_pages_redirect_to_login_and_posts_are_refused(
    ui_service: UIService, page: Page
) -> None:
    key_id = ui_service.create_key(WORKSPACE, "logged-out target")
    page.goto(f"{KEYS}/{key_id}/revoke")
    expect(page).to_have_url(re.compile(r"/login\?next="))
    with httpx.Client(base_url=ui_service.base_url) as http:
        login_page = http.get("/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', login_page.text)
        assert token is not None
        for path in (LIST, f"{KEYS}/{key_id}/revoke", f"{KEYS}/{key_id}/disable"):
            response = http.post(path, data={"csrf_token": token.group(1), "name": "x"})
            assert response.status_code == 403
            assert "not logged in" in response.text
    assert ui_service.status(key_id) == "active"
    # After logging in, the page asked for is the one shown.
    page.fill("#email", EMAIL)
    page.fill("#password", PASSWORD)
    page.click("button:text('Log in')")
    expect(page).to_have_url(re.compile(f"{KEYS}/{key_id}/revoke$"))


# -- how it looks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def showcase(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UIService]:
    """A service of its own, whose workspace holds keys in every state, some of them used."""
    tmp = tmp_path_factory.mktemp("settings-ui-showcase")
    store_url = f"sqlite:///{tmp / 'apikeys.db'}"
    env = service_env(
        APIKEYS_STORE_URL=store_url,
        EXAMPLE_DATABASE_URL=f"sqlite:///{tmp / 'example.db'}",
        EXAMPLE_ADMIN_EMAIL="admin@acme.example",
        EXAMPLE_ADMIN_PASSWORD=PASSWORD,
        EXAMPLE_WORKSPACE="acme",
        EXAMPLE_SESSION_SECRET="settings-ui-showcase-session-secret",
    )
    service = UIService("", store_url)

    async def seed() -> list[str]:
        async with service.manager() as manager:
            zapier = await manager.create(
                name="Zapier", workspace="acme", scopes=["contacts:read", "contacts:write"]
            )
            sync = await manager.create(
                name="Nightly CRM sync",
                workspace="acme",
                full_access=True,
                rate_limit="600/minute",
                expires_in=timedelta(days=90),
            )
            webhook = await manager.create(
                name="Campaign webhook", workspace="acme", scopes=["campaigns:trigger"]
            )
            legacy = await manager.create(name="Legacy import", workspace="acme", full_access=True)
            await manager.disable(webhook.record.id)
            await manager.revoke(legacy.record.id)
            # The row that used to push its buttons off the card: "expires in 59 minutes".
            await manager.create(
                name="Short-lived export",
                workspace="acme",
                scopes=["contacts:read", "campaigns:read"],
                expires_in=timedelta(minutes=59, seconds=50),
            )
            reporting = await manager.create(
                name="Reporting", workspace="acme", scopes=["campaigns:read"]
            )
            await manager.roll(reporting.record.id, grace=timedelta(hours=24))
            # Four weeks of traffic for Zapier's usage chart, some of it refused.
            today = datetime.now(UTC).date()
            daily = {}
            for back in range(28):
                day = (today - timedelta(days=back)).isoformat()
                daily[(day, "admitted")] = (back * 37) % 200 + (0 if back % 7 in (1, 2) else 150)
                if back % 5 == 0:
                    daily[(day, "rate_limited")] = 20 + back
                if back % 9 == 0:
                    daily[(day, "insufficient_scope")] = 6
            await manager.store.add_usage(
                {zapier.record.id: UsageDelta(sum(daily.values()), datetime.now(UTC), daily)},
                batch_id="seed",
            )
        return [zapier.key, sync.key, zapier.record.id]

    *used, zapier_id = run_async(seed)
    service.zapier_id = zapier_id
    log = tmp / "service.log"
    process, service.base_url = start_service(env, log)
    try:
        for key, requests in zip(used, (3, 12), strict=True):
            with service.api(key) as api:
                for _ in range(requests):
                    assert api.get("/api/v1/contacts").status_code == 200
        yield service
    finally:
        stop_service(process, log)


@pytest.mark.parametrize(("name", "viewport"), [("desktop", DESKTOP), ("phone", PHONE)])
def test_settings_page_screenshots(
    browser: Browser, showcase: UIService, name: str, viewport: ViewportSize
) -> None:
    """Screenshots for review in test-artifacts/; and nothing wider than the screen."""
    phone = name == "phone"
    context = browser.new_context(
        base_url=showcase.base_url,
        viewport=viewport,
        device_scale_factor=2 if phone else 1,
        is_mobile=phone,
        has_touch=phone,
    )
    try:
        page = context.new_page()
        page.goto("/login")
        page.screenshot(path=ARTIFACTS / f"settings-ui-{name}-login.png")
        log_in(page, "admin@acme.example")
        key = create_key(page, f"Billing sync ({name})", ["contacts:read", "campaigns:read"])
        page.screenshot(path=ARTIFACTS / f"settings-ui-{name}-new-key.png", full_page=True)
        page.reload()
        assert_key_absent(page, key)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"the page is {width}px wide"
        # Every button of every row lies inside the card that holds the list.
        expect(page.locator(".key-row .cell-status").first).to_be_visible()
        assert "expires in 59 minutes" in page.locator(".keys").inner_text()
        card = page.locator(".card-flush").bounding_box()
        assert card is not None
        buttons = page.locator(".cell-actions .btn")
        assert buttons.count() >= 8
        for index in range(buttons.count()):
            box = buttons.nth(index).bounding_box()
            assert box is not None
            assert box["x"] >= card["x"]
            assert box["x"] + box["width"] <= card["x"] + card["width"] + 0.5, (
                buttons.nth(index).inner_text(),
                box,
                card,
            )
        expect(page.locator(".replaced-by")).to_have_count(1)
        expect(page.locator(".replaces")).to_have_count(1)
        page.screenshot(path=ARTIFACTS / f"settings-ui-{name}.png", full_page=True)
        page.fill("#name", "Broken")
        page.fill("#expires", "soon")
        page.click("button:text('Create key')")
        page.locator("#create").screenshot(path=ARTIFACTS / f"settings-ui-{name}-invalid.png")
        page.goto(f"{KEYS}/{parse_key(key).id}/revoke")
        page.screenshot(path=ARTIFACTS / f"settings-ui-{name}-revoke.png")
        page.goto(f"{KEYS}/{parse_key(key).id}/edit")
        page.locator("details.policies summary").click()
        page.screenshot(path=ARTIFACTS / f"settings-ui-{name}-edit.png", full_page=True)

        # Zapier's last 30 days, as a server-drawn SVG chart.
        page.goto(f"{KEYS}/{showcase.zapier_id}/usage")
        expect(page.locator("h1")).to_contain_text("Usage of key «Zapier»")
        bars = page.locator("#usage-chart .bar")
        expect(bars).to_have_count(30)
        expect(page.locator("#usage-chart rect.refused").first).to_be_visible()
        assert int(page.locator("#usage-admitted").inner_text().replace(",", "")) > 3000
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"the usage page is {width}px wide"
        page.screenshot(path=ARTIFACTS / f"settings-ui-{name}-usage.png", full_page=True)

        # The activity view: every change, newest first, with who made it.
        page.goto(f"{KEYS}/activity")
        expect(page.locator("tr.event").first).to_be_visible()
        actions = page.locator("tr.event .badge-event").all_inner_texts()
        assert {"created", "rolled", "revoked", "disabled"} <= set(actions), actions
        expect(page.locator("tr.event .actor").first).to_have_text("admin@acme.example")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"the activity page is {width}px wide"
        page.screenshot(path=ARTIFACTS / f"settings-ui-{name}-activity.png", full_page=True)
    finally:
        context.close()


# -- the parts, without a browser ------------------------------------------------------------

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("moment", "text"),
    [
        (NOW, "just now"),
        (NOW - timedelta(seconds=42), "42 seconds ago"),
        (NOW - timedelta(minutes=1, seconds=5), "1 minute ago"),
        (NOW - timedelta(minutes=3), "3 minutes ago"),
        (NOW - timedelta(hours=5), "5 hours ago"),
        (NOW - timedelta(days=2), "2 days ago"),
        (NOW + timedelta(hours=23, minutes=59), "in 23 hours"),
        (NOW + timedelta(days=90), "in 3 months"),
    ],
)
def test_relative_times(moment: datetime, text: str) -> None:
    assert relative(moment, NOW) == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("30d", NOW + timedelta(days=30)),
        ("12h", NOW + timedelta(hours=12)),
        ("2026-03-31", datetime(2026, 4, 1, tzinfo=UTC)),  # through the end of that day
        ("2026-03-02T08:00:00Z", datetime(2026, 3, 2, 8, tzinfo=UTC)),
    ],
)
def test_expiry_accepts_durations_and_dates(text: str, expected: datetime | None) -> None:
    assert parse_expiry(text, NOW) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("soon", "like 30d"),
        ("0d", "like 30d"),
        ("2026-02-28", "in the future"),
        ("2026-02-30", "not a date"),
        ("2026-03-02T08:00:00", "time zone"),
        ("9999-12-31", "not a date"),
        ("2400-01-01", "within"),
    ],
)
def test_expiry_refuses_what_it_cannot_read_with_a_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_expiry(text, NOW)


def test_one_time_key_is_given_once_to_its_user_and_forgotten_after_ttl() -> None:
    record = KeyRecord(
        id="AAAAAAAAAAAA",
        name="n",
        workspace="w",
        prefix="ak_AAAAAAAAAAAA_…",
        access="full",
        scopes=(),
        state="active",
        rate_limit=None,
        created_at=NOW,
    )

    async def main() -> None:
        keys = MemoryStore()
        await keys.insert(StoredKey(record=record, secret_hash="h"))
        store = RevealStore(keys, ttl=timedelta(seconds=60))
        nonce = await store.put(Reveal("ak_secret", record, "u_1"))
        assert "ak_secret" not in repr(Reveal("ak_secret", record, "u_1"))
        assert await store.pop(nonce, "u_2") is None  # another user's session cannot take it
        revealed = await store.pop(nonce, "u_1")
        assert revealed is not None
        assert revealed.key == "ak_secret"
        assert await store.pop(nonce, "u_1") is None  # once
        expired = RevealStore(keys, ttl=timedelta(0))
        gone = await expired.put(Reveal("ak_secret", record, "u_1"))
        assert await expired.pop(gone, "u_1") is None
        assert len(keys._once) == 0

    run_async(main)


def test_settings_never_show_the_password_or_session_secret() -> None:
    settings = Settings.from_env(
        {
            "EXAMPLE_ADMIN_EMAIL": "a@example.com",
            "EXAMPLE_ADMIN_PASSWORD": "hunter2-hunter2",
            "EXAMPLE_SESSION_SECRET": "the-session-secret",
        }
    )
    assert "hunter2" not in repr(settings)
    assert "the-session-secret" not in repr(settings)
    with pytest.raises(ValueError, match="both"):
        Settings.from_env({"EXAMPLE_ADMIN_EMAIL": "a@example.com"})
    with pytest.raises(ValueError, match="at least 8"):
        Settings.from_env({"EXAMPLE_ADMIN_EMAIL": "a@example.com", "EXAMPLE_ADMIN_PASSWORD": "x"})


def test_a_rolled_key_shows_and_spends_the_credits_of_its_successor(
    ui_service: UIService, page: Page
) -> None:
    log_in(page)
    # Credits are the operator's to grant.
    key = ui_service.issue(WORKSPACE, "Metered", scopes=["contacts:read"], credits=10)
    old_id = parse_key(key).id
    with ui_service.api(key) as api:
        for _ in range(4):
            assert api.get("/api/v1/contacts").status_code == 200
    page.goto(f"{KEYS}/{old_id}/roll")
    page.click("button:text('Roll key')")
    new_key = page.input_value("#new-key-value")
    page.goto(LIST)
    expect(row(page, key).locator(".credits")).to_have_text(
        "6 credits left, shared with its successor"
    )
    expect(row(page, new_key).locator(".credits")).to_have_text("6 credits left")

    with ui_service.api(key) as old_api, ui_service.api(new_key) as new_api:
        answers = [api.get("/api/v1/contacts") for api in (old_api, new_api) * 4]
    assert [answer.status_code for answer in answers] == [200] * 6 + [429] * 2
    assert_problem(answers[-1], 429, "credits_exhausted")
    page.goto(LIST)
    expect(row(page, key).locator(".credits")).to_contain_text("0 credits left")
    expect(row(page, new_key).locator(".credits")).to_have_text("0 credits left")

    # Shown read-only on the edit page; sent anyway, refused (403), and nothing changes.
    page.goto(f"{KEYS}/{old_id}/edit")
    expect(page.locator("#credits")).to_have_count(0)
    expect(page.locator("#credits-value")).to_have_text("0")
    posted = page.context.request.post(
        f"{KEYS}/{old_id}/edit",
        form={
            "csrf_token": csrf(page),
            "name": "Metered",
            "access": "restricted",
            "scopes": "contacts:read",
            "expires": page.input_value("#expires"),
            "credits": "1000",
        },
    )
    assert posted.status == 403
    assert "forbidden_field" in posted.text()
    with ui_service.api(key) as old_api:
        assert_problem(old_api.get("/api/v1/contacts"), 429, "credits_exhausted")


def test_the_page_shows_each_key_as_live_or_test(ui_service: UIService, page: Page) -> None:
    # The environment is the operator's to choose at create; the page shows it, fixed.
    log_in(page)
    live = ui_service.issue(WORKSPACE, "Production", scopes=["contacts:read"])
    sandbox = ui_service.issue(WORKSPACE, "Sandbox", scopes=["contacts:read"], environment="test")
    page.goto(LIST)
    expect(row(page, live).locator(".environment")).to_have_text("live")
    expect(row(page, sandbox).locator(".environment")).to_have_text("test")
    expect(row(page, sandbox).locator(".masked")).to_have_text(f"ak_test_{parse_key(sandbox).id}_…")
    page.goto(f"{KEYS}/{parse_key(sandbox).id}/edit")
    expect(page.locator("#environment")).to_have_count(0)
