"""The workspace's webhook deliveries, newest first: event, key, status, attempts; and
sending one of them again."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from apikeys.errors import KeyNotFound
from apikeys.types import utcnow
from apikeys.ui.forms import Form
from apikeys.ui.request import (
    PageError,
    PageUser,
    action,
    base_path,
    notice,
    page_of,
    redirect,
    render,
    view,
)

__all__ = ["DELIVERIES_LIMIT", "deliveries_page", "replay"]

DELIVERIES_LIMIT = 200


@view
async def deliveries_page(request: Request, user: PageUser) -> Response:
    """The deliveries of events about the workspace's keys (never a secret of an endpoint,
    nor the URL of one that is not the workspace's own)."""
    page = page_of(request)
    names = {r.id: r for r in await page.manager.list(user.workspace)}
    hooks = page.manager.store.webhooks()
    deliveries = []
    urls: dict[str, str] = {}
    if hooks is not None:
        # The URLs of the workspace's own endpoints only. One sent every workspace's events
        # is the operator's, and its URL may be a credential (a chat service's incoming
        # webhook): it is shown by its id.
        urls = {
            endpoint.id: endpoint.url
            for endpoint in await hooks.endpoints()
            if endpoint.workspace == user.workspace
        }
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
        notice=request.session.pop("notice", None),
    )


@action
async def replay(request: Request, user: PageUser, form: Form) -> Response:
    """Send a listed delivery again (same id and body, 24 hours of retries anew), when it is
    about a key of the user's workspace; any other id is the 404 page."""
    manager = page_of(request).manager
    hooks = manager.store.webhooks()
    delivery_id: str = request.path_params["delivery_id"]
    listed = [] if hooks is None else await hooks.deliveries(limit=DELIVERIES_LIMIT)
    found = next((delivery for delivery in listed if delivery.id == delivery_id), None)
    try:
        mine = found is not None and (await manager.get(found.key_id)).workspace == user.workspace
    except KeyNotFound:
        mine = False
    if hooks is None or found is None or not mine:
        raise PageError(404, "No such delivery", "This delivery is not one of your keys'.")
    await hooks.replay(found.id, utcnow())
    notice(request, f"The {found.event} delivery will be sent again.")
    return redirect(base_path(request) + "/webhooks")
