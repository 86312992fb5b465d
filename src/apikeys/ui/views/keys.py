"""The list of the workspace's keys, and creating a key (shown once on the list)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from starlette.requests import Request
from starlette.responses import Response

from apikeys.errors import ConfigurationError, InvalidKeyParameters
from apikeys.fields import Role, check_change
from apikeys.identities import IdentityRecord
from apikeys.lifecycle import offered
from apikeys.manager import KeyManager
from apikeys.types import REVOKED, KeyRecord, utcnow
from apikeys.ui.forms import Form, KeyForm, read_key_form, read_policies, requested_changes
from apikeys.ui.onetime import Reveal
from apikeys.ui.request import PageUser, action, base_path, page_of, redirect, render, view

__all__ = ["STATUS_FILTERS", "KeyRow", "create", "list_page", "show_list"]

# `?status=` of the list: the filter's value, and its label ("" is every key in use).
STATUS_FILTERS: tuple[tuple[str, str], ...] = (
    ("", "In use"),
    ("active", "Active"),
    ("disabled", "Disabled"),
    ("expired", "Expired"),
    ("revoked", "Revoked"),
)


@dataclass(frozen=True, slots=True)
class KeyRow:
    """A key as the list shows it, with the actions it offers."""

    record: KeyRecord
    status: str
    replaced_by: KeyRecord | None
    replaces: KeyRecord | None
    now: datetime
    identity: IdentityRecord | None = None
    """The identity the key belongs to, shown read-only: its limits and credits are the
    operator's (CONTRACT 12)."""

    @property
    def being_replaced(self) -> bool:
        """Rolled: its successor takes over, so it offers no Roll or Disable."""
        return self.record.replaced_by is not None

    # What the list offers is what the key's rules allow (`apikeys.lifecycle.offered`).
    @property
    def can_disable(self) -> bool:
        return offered(self.record, "disable", self.now)

    @property
    def can_enable(self) -> bool:
        return offered(self.record, "enable", self.now)

    @property
    def can_roll(self) -> bool:
        return offered(self.record, "roll", self.now)

    @property
    def can_edit(self) -> bool:
        return offered(self.record, "update", self.now)

    @property
    def can_revoke(self) -> bool:
        return offered(self.record, "revoke", self.now)

    @property
    def has_actions(self) -> bool:
        return self.can_disable or self.can_enable or self.can_roll or self.can_revoke


def _rows(
    records: list[KeyRecord], now: datetime, identities: Mapping[str, IdentityRecord]
) -> list[KeyRow]:
    by_id = {record.id: record for record in records}
    return [
        KeyRow(
            record=record,
            status=record.status_at(now),
            replaced_by=by_id.get(record.replaced_by or ""),
            replaces=by_id.get(record.replaces or ""),
            now=now,
            identity=identities.get(record.identity or ""),
        )
        for record in reversed(records)  # newest first
    ]


async def _identities_of(
    manager: KeyManager, workspace: str, records: list[KeyRecord]
) -> dict[str, IdentityRecord]:
    """The identities of `workspace` that `records` belong to, by id; none read when no
    key belongs to one (nor from a store that keeps no identities)."""
    if not any(record.identity for record in records):
        return {}
    try:
        listed = await manager.list_identities(workspace)
    except ConfigurationError:
        return {}
    return {identity.id: identity for identity in listed}


async def show_list(
    request: Request,
    user: PageUser,
    *,
    form: KeyForm | None = None,
    errors: dict[str, str] | None = None,
    status: int = 200,
) -> Response:
    page = page_of(request)
    reveal: Reveal | None = None
    reveal_lost = False
    if "reveal" in request.session:
        # Forgotten only once answered: if the store cannot be reached, a reload shows it.
        reveal = await page.reveals.pop(request.session["reveal"], user.id)
        del request.session["reveal"]
        reveal_lost = reveal is None
    now = utcnow()
    records = await page.manager.list(user.workspace)
    rows = _rows(records, now, await _identities_of(page.manager, user.workspace, records))
    # Revoked keys stay in the list for audit, but folded away unless asked for: the list
    # would otherwise grow with every revoke and roll.
    wanted = request.query_params.get("status", "")
    if wanted not in dict(STATUS_FILTERS):
        wanted = ""
    hidden_revoked = 0
    if wanted:
        rows = [row for row in rows if row.status == wanted]
    else:
        hidden_revoked = sum(row.status == REVOKED for row in rows)
        rows = [row for row in rows if row.status != REVOKED]
    return render(
        request,
        "keys.html",
        status=status,
        title="API keys",
        rows=rows,
        now=now,
        reveal=reveal,
        reveal_lost=reveal_lost,
        notice=request.session.pop("notice", None),
        form=form or KeyForm(),
        errors=errors or {},
        scopes=tuple(page.scope_labels),
        default_rate_limit=page.default_rate_limit,
        editable=page.editable_fields,
        status_filters=STATUS_FILTERS,
        status_filter=wanted,
        hidden_revoked=hidden_revoked,
    )


@view
async def list_page(request: Request, user: PageUser) -> Response:
    return await show_list(request, user)


@action
async def create(request: Request, user: PageUser, form: Form) -> Response:
    page = page_of(request)
    values, errors, expires_at = read_key_form(form, page.scope_labels)
    policy = read_policies(form, values, errors)
    check_change(
        requested_changes(form, values, errors, expires_at, policy),
        role=Role.WORKSPACE,
        workspace_fields=page.workspace_fields,
    )
    if not errors:
        assert expires_at is None or isinstance(expires_at, datetime)
        try:
            created = await page.manager.create(
                name=values.name,
                workspace=user.workspace,
                scopes=values.scopes if values.access == "restricted" else (),
                full_access=values.access == "full",
                rate_limit=values.rate_limit or None,
                expires_at=expires_at,
                actor=user.name,
                **policy,
            )
        except InvalidKeyParameters as exc:
            errors["form"] = str(exc)
    if errors:
        return await show_list(request, user, form=values, errors=errors, status=422)
    reveal = Reveal(created.key, created.record, user.id, unconfirmed=not created.confirmed)
    request.session["reveal"] = await page.reveals.put(reveal)
    return redirect(f"{base_path(request)}/#new-key")
