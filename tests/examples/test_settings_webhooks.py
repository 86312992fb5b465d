"""The example service delivers webhooks, and its settings page lists the deliveries.

A key created in the browser sends `key.created` to a receiver started here, signed with
the endpoint's secret; the settings page's Webhooks view shows the delivery as delivered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from playwright.sync_api import Page, expect
from standardwebhooks import Webhook

from apikeys import parse_key, store_from_url
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.model import Endpoint
from tests.examples.test_settings_ui import (  # noqa: F401 - fixtures used by name
    KEYS,
    WORKSPACE,
    UIService,
    browser,
    context,
    create_key,
    log_in,
    page,
    run_async,
    ui_service,
)

Received = list[tuple[dict[str, str], bytes]]


@pytest.fixture
def receiver() -> Iterator[tuple[str, Received]]:
    received: Received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            received.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hooks", received
    finally:
        server.shutdown()
        server.server_close()


def _add_endpoint(store_url: str, url: str) -> Endpoint:
    async def add() -> Endpoint:
        store = store_from_url(store_url)
        try:
            hooks = store.webhooks()
            assert hooks is not None
            # The page shows the URLs of its workspace's own endpoints (not the operator's).
            return await add_endpoint(hooks, url, workspace=WORKSPACE, allow_private=True)
        finally:
            await store.aclose()

    return run_async(add)


def test_the_settings_page_lists_the_deliveries_the_service_made(
    ui_service: UIService,  # noqa: F811 - the fixture imported above
    page: Page,  # noqa: F811
    receiver: tuple[str, Received],
) -> None:
    url, received = receiver
    endpoint = _add_endpoint(ui_service.store_url, url)
    log_in(page)
    key = create_key(page, "webhooked")
    key_id = parse_key(key).id
    deadline = time.monotonic() + 30
    while not any(b'"key.created"' in body and key_id.encode() in body for _, body in received):
        assert time.monotonic() < deadline, "no delivery within 30 seconds"
        time.sleep(0.1)
    headers, body = next((h, b) for h, b in received if key_id.encode() in b)
    event = Webhook(endpoint.secret).verify(body, headers)
    assert event["type"] == "key.created"
    assert event["data"]["key"]["id"] == key_id
    assert parse_key(key).secret.encode() not in body

    # The receiver holds the body before its 204 reaches the deliverer, which marks the
    # delivery delivered only then: the page is loaded again until it shows that.
    deadline = time.monotonic() + 30
    while True:
        page.goto(f"{KEYS}/webhooks")
        row = page.locator(f"tr.delivery[data-key-id='{key_id}']")
        expect(row).to_have_count(1)
        if row.locator(".status").inner_text().strip() != "pending":
            break
        assert time.monotonic() < deadline, "still pending after 30 seconds"
        time.sleep(0.2)
    expect(row.locator(".status")).to_have_text("delivered")
    expect(row).to_contain_text("key.created")
    expect(row).to_contain_text("204")
    expect(row).to_contain_text(url)
    assert endpoint.secret not in page.content()


def test_the_settings_page_replays_a_delivery_with_its_id_and_body(
    ui_service: UIService,  # noqa: F811 - the fixture imported above
    page: Page,  # noqa: F811
    receiver: tuple[str, Received],
) -> None:
    url, received = receiver
    endpoint = _add_endpoint(ui_service.store_url, url)
    log_in(page)
    key_id = parse_key(create_key(page, "replayed")).id

    def sent() -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for h, b in received if key_id.encode() in b]

    deadline = time.monotonic() + 30
    while not sent():
        assert time.monotonic() < deadline, "no delivery within 30 seconds"
        time.sleep(0.1)
    page.goto(f"{KEYS}/webhooks")
    # The rows of this test's endpoint (the service's other tests may have added others).
    row = page.locator(f"tr.delivery[data-key-id='{key_id}']", has_text=url)
    expect(row.locator(".status")).to_have_text("delivered")
    row.get_by_role("button", name="Send the key.created delivery again").click()
    expect(page.get_by_text("The key.created delivery will be sent again.")).to_be_visible()
    deadline = time.monotonic() + 30
    while len(sent()) < 2:
        assert time.monotonic() < deadline, "not sent again within 30 seconds"
        time.sleep(0.1)
    (first_headers, first_body), (again_headers, again_body) = sent()[:2]
    assert again_headers["webhook-id"] == first_headers["webhook-id"]
    assert again_body == first_body
    Webhook(endpoint.secret).verify(again_body, again_headers)

    # A delivery id that is not listed for this workspace is the 404 page, nothing sent.
    page.goto(f"{KEYS}/webhooks")
    page.locator(f"tr.delivery[data-key-id='{key_id}']", has_text=url).locator("form").evaluate(
        "form => { form.action = form.action.replace(/webhooks\\/[^/]+\\/replay/,"
        " 'webhooks/not-a-delivery/replay'); form.submit(); }"
    )
    expect(page.get_by_text("No such delivery")).to_be_visible()
    assert len(sent()) == 2
