"""The workspace's activity: its audit trail, newest first."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from apikeys.errors import KeyNotFound
from apikeys.types import KeyRecord, utcnow
from apikeys.ui.request import KEY_ID, PageError, PageUser, page_of, render, view

__all__ = ["ACTIVITY_LIMIT", "activity_page"]

ACTIVITY_LIMIT = 200


@view
async def activity_page(request: Request, user: PageUser) -> Response:
    """The workspace's audit trail, newest first; `?key=ID` for one key's."""
    page = page_of(request)
    key_id = request.query_params.get("key", "")
    record: KeyRecord | None = None
    if key_id:
        if not KEY_ID.fullmatch(key_id):
            raise PageError.no_such_key()
        try:
            record = await page.manager.get(key_id)
        except KeyNotFound:
            raise PageError.no_such_key() from None
        if record.workspace != user.workspace:
            raise PageError.no_such_key()
    events = await page.manager.audit(
        workspace=user.workspace, key_id=key_id or None, limit=ACTIVITY_LIMIT
    )
    names = {r.id: r for r in await page.manager.list(user.workspace)}
    return render(
        request,
        "activity.html",
        title="Activity",
        events=list(reversed(events)),
        names=names,
        record=record,
        now=utcnow(),
        limit=ACTIVITY_LIMIT,
    )
