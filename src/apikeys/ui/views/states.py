"""Disabling, enabling and revoking a key."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from apikeys.errors import InvalidTransition
from apikeys.lifecycle import refusal
from apikeys.types import ACTIVE, DISABLED, REVOKED
from apikeys.ui.forms import Form
from apikeys.ui.request import (
    PageError,
    PageUser,
    action,
    base_path,
    notice,
    own_key,
    page_of,
    redirect,
    refused,
    render,
    view,
)

__all__ = ["disable", "enable", "revoke", "revoke_page"]


async def _change_state(
    request: Request, user: PageUser, method: str, target: str, verb: str, outcome: str
) -> Response:
    record = await own_key(request, user)
    manager = page_of(request).manager
    why = refusal(record, method)  # None for a key in `target` already
    if why is not None:
        raise PageError(
            409,
            f"This key cannot be {verb}",
            f"Key “{record.name}” ({record.prefix}) cannot be {verb}: {why}.",
        )
    try:
        await getattr(manager, method)(record.id, actor=user.name)
    except InvalidTransition:
        current = await manager.get(record.id)
        if current.state != target:  # already done (a second click) is not an error
            raise refused(current, verb) from None
    notice(request, f"Key “{record.name}” ({record.prefix}) is {verb}. {outcome}")
    return redirect(base_path(request) + "/")


@action
async def disable(request: Request, user: PageUser, form: Form) -> Response:
    return await _change_state(
        request,
        user,
        "disable",
        DISABLED,
        "disabled",
        "Requests with it get 401 until you enable it again.",
    )


@action
async def enable(request: Request, user: PageUser, form: Form) -> Response:
    return await _change_state(
        request, user, "enable", ACTIVE, "enabled", "It authenticates requests again."
    )


@view
async def revoke_page(request: Request, user: PageUser) -> Response:
    record = await own_key(request, user)
    if record.state == REVOKED:
        raise refused(record, "revoked")
    return render(request, "revoke.html", title="Revoke key", record=record)


@action
async def revoke(request: Request, user: PageUser, form: Form) -> Response:
    return await _change_state(
        request,
        user,
        "revoke",
        REVOKED,
        "revoked",
        "Every request with it now gets 401. It stays in the list for the record.",
    )
