"""The workspace's webhook deliveries, newest first: event, key, status, attempts."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from apikeys.types import utcnow
from apikeys.ui.request import PageUser, page_of, render, view

__all__ = ["DELIVERIES_LIMIT", "deliveries_page"]

DELIVERIES_LIMIT = 200


@view
async def deliveries_page(request: Request, user: PageUser) -> Response:
    """The deliveries of events about the workspace's keys (never a secret of an endpoint)."""
    page = page_of(request)
    names = {r.id: r for r in await page.manager.list(user.workspace)}
    hooks = page.manager.store.webhooks()
    deliveries = []
    urls: dict[str, str] = {}
    if hooks is not None:
        urls = {endpoint.id: endpoint.url for endpoint in await hooks.endpoints()}
        deliveries = [
            delivery
            for delivery in await hooks.deliveries(limit=DELIVERIES_LIMIT)
            if delivery.key_id in names
        ]
    return render(
        request,
        "webhooks.html",
        title="Webhook deliveries",
        deliveries=deliveries,
        names=names,
        urls=urls,
        available=hooks is not None,
        now=utcnow(),
        limit=DELIVERIES_LIMIT,
    )
