"""Rolling a key: a new key (shown once on the list) replaces it after a grace period."""

from __future__ import annotations

from datetime import timedelta

from starlette.requests import Request
from starlette.responses import Response

from apikeys.durations import format_duration
from apikeys.errors import InvalidTransition
from apikeys.manager import refusal
from apikeys.types import KeyRecord
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


def _lifetime(record: KeyRecord) -> str | None:
    """How long the key was made to last, to the minute ("30d", not "29d23h59m59s")."""
    if record.expires_at is None:
        return None
    seconds = (record.expires_at - record.created_at).total_seconds()
    if seconds >= 3600:
        seconds = round(seconds / 60) * 60
    return format_duration(timedelta(seconds=max(1, round(seconds))))


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
        lifetime=_lifetime(record),
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
    try:
        created = await page.manager.roll(record.id, grace=GRACE_CHOICES[grace][1], actor=user.name)
    except InvalidTransition:
        raise refused(await page.manager.get(record.id), "rolled") from None
    old = await page.manager.get(record.id)
    reveal = Reveal(
        created.key, created.record, user.id, rolled_from=old, unconfirmed=not created.confirmed
    )
    request.session["reveal"] = await page.reveals.put(reveal)
    return redirect(f"{base_path(request)}/#new-key")
