"""The settings page served by two uvicorn workers: every new key is shown exactly once.

The example service runs as `docs/deploying.md` runs it, with several workers (here 2) on
one shared key store (SQLite, then PostgreSQL), in Debian's Chromium. After a create the
browser is redirected to the list, which any worker may serve: it must show the key there,
and a second display, the page reloaded with the very cookie that carried the key's half,
must say it was shown already, which is then true.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn.config
from playwright.sync_api import Browser, Page, expect

from tests import services
from tests.conftest import _create_database, _drop_database
from tests.examples.conftest import service_env, start_service, stop_service
from tests.examples.test_settings_ui import (
    DESKTOP,
    EMAIL,
    KEY_RE,
    KEYS,
    LIST,
    PAGE_COOKIE,
    PASSWORD,
    UIService,
    log_in,
    run_async,
)
from tests.examples.test_settings_ui import browser as browser  # the Chromium fixture

KEYS_TO_CREATE = 8
ALREADY_SHOWN = "it has been shown once already, or more than 5 minutes have passed"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def two_workers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UIService]:
    database = ""
    if request.param == "sqlite":
        store_url = f"sqlite:///{tmp_path / 'apikeys.db'}"
    else:
        # A database of the test's own, made in a thread: Playwright runs an event loop here.
        services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
        database = f"apikeys_workers_{uuid.uuid4().hex[:12]}"
        run_async(lambda: _create_database(services.POSTGRES_URL, database))
        store_url = f"{services.POSTGRES_URL.rsplit('/', 1)[0]}/{database}"
    env = service_env(
        APIKEYS_STORE_URL=store_url,
        EXAMPLE_DATABASE_URL=f"sqlite:///{tmp_path / 'example.db'}",
        EXAMPLE_ADMIN_EMAIL=EMAIL,
        EXAMPLE_ADMIN_PASSWORD=PASSWORD,
        EXAMPLE_WORKSPACE=f"workers-{uuid.uuid4().hex[:8]}",
        EXAMPLE_SESSION_SECRET="settings-ui-workers-test-session-secret",
    )
    log = tmp_path / "service.log"
    # No connection is kept alive, as behind a proxy that spreads requests over its
    # connections to the workers: each request goes to whichever worker accepts it, and
    # the access log names that worker's process.
    options = ["--workers", "2", "--timeout-keep-alive", "0", "--log-config"]
    process, base_url = start_service(env, log, *options, str(log_config(tmp_path)))
    try:
        yield UIService(base_url, store_url)
    finally:
        stop_service(process, log)
        if database:
            run_async(lambda: _drop_database(services.POSTGRES_URL, database))
    output = log.read_text()
    assert PASSWORD not in output
    assert not KEY_RE.search(output)  # no key is ever logged
    # Both workers served the list, where new keys are shown: nothing was sticky.
    served = set(re.findall(rf"^worker (\d+) .*\"GET {LIST} HTTP", output, re.MULTILINE))
    assert len(served) == 2, output


def log_config(folder: Path) -> Path:
    """uvicorn's own logging configuration, with the worker's process id in the access log."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["formatters"]["access"]["fmt"] = (
        'worker %(process)d %(client_addr)s - "%(request_line)s" %(status_code)s'
    )
    path = folder / "logging.json"
    path.write_text(json.dumps(config))
    return path


def page_cookie_of(set_cookies: list[str]) -> str:
    """The page cookie's value among a response's `Set-Cookie` headers."""
    for header in set_cookies:
        name, _, rest = header.partition("=")
        if name.strip() == PAGE_COOKIE:
            return rest.split(";", 1)[0]
    raise AssertionError(f"no {PAGE_COOKIE} cookie set: {set_cookies}")


def test_with_two_workers_every_new_key_is_shown_exactly_once(
    two_workers: UIService, browser: Browser
) -> None:
    context = browser.new_context(base_url=two_workers.base_url, viewport=DESKTOP)
    context.set_default_timeout(10_000)
    try:
        page = context.new_page()
        log_in(page)
        expect(page).to_have_url(re.compile(LIST + "$"))
        shown: list[str] = []
        lost: list[int] = []
        for number in range(KEYS_TO_CREATE):
            key = create(page, f"Integration {number}", lost, number)
            if key is None:
                continue
            shown.append(key)
            with two_workers.api(key) as api:
                assert api.get("/api/v1/contacts").status_code == 200
            # Shown once: a plain reload shows neither the key nor a message.
            page.reload()
            expect(page.locator("#new-key")).to_have_count(0)
            assert key not in page.content()
        assert lost == [], f"shown {len(shown)} of {KEYS_TO_CREATE} new keys; lost: {lost}"
        assert len(set(shown)) == KEYS_TO_CREATE
    finally:
        context.close()


def create(page: Page, name: str, lost: list[int], number: int) -> str | None:
    """Create a key; the key the page shows, or None (noted in `lost`) if it says it cannot.

    Then the page is loaded again with the cookie that carried the key's half (as a second
    tab, or a replayed request, would): it must say the key was shown already, and not
    show it.
    """
    page.goto(KEYS)
    page.fill("#name", name)
    page.check("input[name=access][value=full]")
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        page.click("button:text('Create key')")
    carried = page_cookie_of(posted.value.header_values("set-cookie"))
    new_key = page.locator("#new-key")
    lost_note = page.get_by_text(ALREADY_SHOWN)
    expect(new_key.or_(lost_note)).to_be_visible()
    if new_key.count() == 0:
        lost.append(number)
        return None
    key = page.input_value("#new-key-value")
    assert KEY_RE.fullmatch(key), key

    [current] = [c for c in page.context.cookies() if c["name"] == PAGE_COOKIE]
    assert current["value"] != carried  # the page that showed the key dropped its half
    page.context.add_cookies([{**current, "value": carried}])
    page.goto(KEYS)
    expect(lost_note).to_be_visible()
    expect(page.locator("#new-key")).to_have_count(0)
    assert key not in page.content()
    return key
