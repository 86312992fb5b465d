"""Editing a key: its name, access and expiry, and the fields the operator lets workspace
users set (`KeysPage(workspace_fields=...)`); the others are shown, read-only."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from apikeys.errors import InvalidKeyParameters, InvalidTransition
from apikeys.fields import Role, check_change
from apikeys.lifecycle import refusal
from apikeys.manager import UNSET
from apikeys.types import REVOKED, KeyRecord
from apikeys.ui.forms import (
    UNCHANGED,
    Form,
    KeyForm,
    read_key_form,
    read_policies,
    requested_changes,
)
from apikeys.ui.request import (
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

__all__ = ["edit", "edit_page"]


def _show_edit(
    request: Request,
    record: KeyRecord,
    form: KeyForm,
    errors: dict[str, str],
    *,
    status: int = 200,
) -> Response:
    page = page_of(request)
    offered = tuple(dict.fromkeys([*page.scope_labels, *record.scopes]))
    return render(
        request,
        "edit.html",
        status=status,
        title="Edit key",
        record=record,
        form=form,
        errors=errors,
        scopes=offered,
        default_rate_limit=page.default_rate_limit,
        editable=page.editable_fields,
        shown=KeyForm.of(record),
    )


@view
async def edit_page(request: Request, user: PageUser) -> Response:
    record = await own_key(request, user)
    if refusal(record, "update") is not None:
        raise refused(record, "edited")
    return _show_edit(request, record, KeyForm.of(record), {})


@action
async def edit(request: Request, user: PageUser, form: Form) -> Response:
    record = await own_key(request, user)
    if refusal(record, "update") is not None:
        raise refused(record, "edited")
    page = page_of(request)
    values, errors, expires_at = read_key_form(form, page.scope_labels, current=record)
    policy = read_policies(form, values, errors)
    # Before anything is read further: a field that is not the user's is refused (403),
    # whatever its value.
    check_change(
        requested_changes(form, values, errors, expires_at, policy),
        role=Role.WORKSPACE,
        current=record,
        workspace_fields=page.workspace_fields,
    )
    if errors:
        return _show_edit(request, record, values, errors, status=422)
    full = values.access == "full"
    if "credits" in policy and values.credits == KeyForm.of(record).credits:
        # Left as shown: requests may have spent some since the form was drawn.
        del policy["credits"]
    try:
        await page.manager.update(
            record.id,
            name=values.name,
            full_access=full,
            scopes=None if full else values.scopes,
            rate_limit=(values.rate_limit or None) if "rate_limit" in form else UNSET,
            expires_at=UNSET if expires_at is UNCHANGED else expires_at,  # type: ignore[arg-type]
            actor=user.name,
            **policy,
        )
    except InvalidTransition as exc:
        current = await page.manager.get(record.id)
        if current.state != REVOKED and current.replaced_by is not None:
            # A rolled key's credits are its successor's: said beside the field.
            why = f"This key {exc.why.removeprefix('it ')}."
            return _show_edit(request, record, values, {"credits": why}, status=422)
        raise refused(current, "edited") from None
    except InvalidKeyParameters as exc:
        return _show_edit(request, record, values, {"form": str(exc)}, status=422)
    notice(
        request,
        f"Key “{values.name}” ({record.prefix}) is saved. The next request with it is "
        "checked against what you saved.",
    )
    return redirect(f"{base_path(request)}/#key-{record.id}")
