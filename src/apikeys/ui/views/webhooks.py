"""The workspace's webhook deliveries, newest first: event, key, status, attempts; and
sending one of them again.

A delivery is the workspace's when the key its event is about is (`Delivery.workspace`),
whichever endpoint it goes to: one of the workspace's own, or one for every workspace (the
operator's). An endpoint's workspace would hide the latter from everyone, and a delivery
about a key is that key's workspace's business. The store lists a workspace's deliveries
and finds one by its id, so a busy workspace hides no other's and an old delivery is still
found; one of another workspace is the same 404 as one that does not exist.
"""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import Response

from apikeys.errors import DeliveryInProgress
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

# What a delivery id can be (`msg_` and hex, from the stores); anything else is not looked
# up: a NUL byte or a newline has no business in a query.
_DELIVERY_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
        deliveries = await hooks.deliveries(workspace=user.workspace, limit=DELIVERIES_LIMIT)
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
    """Send a delivery again (same id and body, 24 hours of retries anew), when it is
    about a key of the user's workspace, however old; any other id is the 404 page."""
    hooks = page_of(request).manager.store.webhooks()
    delivery_id: str = request.path_params["delivery_id"]
    found = None
    if hooks is not None and _DELIVERY_ID.fullmatch(delivery_id):
        found = await hooks.delivery(delivery_id)
    if hooks is None or found is None or found.workspace != user.workspace:
        raise PageError(404, "No such delivery", "This delivery is not one of your keys'.")
    try:
        await hooks.replay(found.id, utcnow())
    except DeliveryInProgress:
        notice(request, f"The {found.event} delivery is being sent now: try again in a minute.")
    else:
        notice(request, f"The {found.event} delivery will be sent again.")
    return redirect(base_path(request) + "/webhooks")
