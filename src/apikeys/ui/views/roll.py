"""Rolling a key: a new key (shown once on the list) replaces it after a grace period."""

from __future__ import annotations

from datetime import timedelta

from starlette.requests import Request
from starlette.responses import Response

from apikeys.errors import InvalidKeyParameters, InvalidTransition
from apikeys.fields import workspace_roll_expiry
from apikeys.lifecycle import refusal
from apikeys.types import KeyRecord, utcnow
from apikeys.ui.forms import Form
from apikeys.ui.onetime import Reveal
from apikeys.ui.request import (
    PageError,
    PageUser,
    action,
    base_path,
    own_key,
    page_of,
    redirect,
    refused,
    render,
    view,
)

__all__ = ["DEFAULT_GRACE", "GRACE_CHOICES", "roll", "roll_page"]

GRACE_CHOICES: dict[str, tuple[str, timedelta]] = {
    "0": ("None: the old key stops working now", timedelta(0)),
    "1h": ("1 hour", timedelta(hours=1)),
    "24h": ("24 hours", timedelta(hours=24)),
    "7d": ("7 days", timedelta(days=7)),
}
DEFAULT_GRACE = "24h"


def _show_roll(
    request: Request, record: KeyRecord, *, grace: str, error: str | None, status: int
) -> Response:
    return render(
        request,
        "roll.html",
        status=status,
        title="Roll key",
        record=record,
        grace=grace,
        grace_choices=GRACE_CHOICES,
        error=error,
    )


def _check_rollable(record: KeyRecord) -> None:
    why = refusal(record, "roll")
    if why is not None:
        raise PageError(
            409,
            "This key cannot be rolled",
            f"Key “{record.name}” ({record.prefix}) cannot be rolled: {why}.",
        )


@view
async def roll_page(request: Request, user: PageUser) -> Response:
    record = await own_key(request, user)
    _check_rollable(record)
    workspace_roll_expiry(record, utcnow())  # an expired key: the 403 page now
    return _show_roll(request, record, grace=DEFAULT_GRACE, error=None, status=200)


@action
async def roll(request: Request, user: PageUser, form: Form) -> Response:
    record = await own_key(request, user)
    _check_rollable(record)
    grace = form.get("grace", "")
    if grace not in GRACE_CHOICES:
        return _show_roll(
            request,
            record,
            grace=DEFAULT_GRACE,
            error="Choose how long the old key keeps working.",
            status=422,
        )
    page = page_of(request)
    # Never later than the key's own expiry: that is the operator's to move.
    expires_at = workspace_roll_expiry(record, utcnow())
    try:
        created = await page.manager.roll(
            record.id, grace=GRACE_CHOICES[grace][1], expires_at=expires_at, actor=user.name
        )
    except InvalidTransition:
        raise refused(await page.manager.get(record.id), "rolled") from None
    except InvalidKeyParameters:
        # The key expired since it was read: refused as it would be now.
        workspace_roll_expiry(record, utcnow())
        raise
    old = await page.manager.get(record.id)
    reveal = Reveal(
        created.key, created.record, user.id, rolled_from=old, unconfirmed=not created.confirmed
    )
    request.session["reveal"] = await page.reveals.put(reveal)
    return redirect(f"{base_path(request)}/#new-key")
