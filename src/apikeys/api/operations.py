"""The management API's operations, as data: each one's method, path, the scope it needs,
its body and its answer. The app's routes, its scope table and its OpenAPI document are all
made from this one table (`apikeys.api.app`, `apikeys.api.openapi`).

The three scopes:

- `apikeys:read` reads the workspace's keys, identities, usage and audit trail;
- `apikeys:write` creates, edits, rolls, disables, enables and revokes the workspace's keys,
  as a workspace user may (`apikeys.fields`);
- `apikeys:admin` creates and changes the workspace's identities.

The webhook operations (`/webhooks…`) are the operators' only: a caller of one of the
workspaces `ManagementAPI(operators=…)` names, whose key names `apikeys:admin` among its
scopes (`apikeys.api.webhooks`). To every other caller they answer as a path that is no
operation does, so their route rule asks what such a path asks (`apikeys:read`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from apikeys.api.schemas import (
    IDENTITY_CREATE,
    IDENTITY_UPDATE,
    KEY_CREATE,
    KEY_UPDATE,
    NO_BODY,
    ROLL,
    WEBHOOK_CREATE,
    WEBHOOK_ROLL,
)

__all__ = ["ADMIN_SCOPE", "OPERATIONS", "READ_SCOPE", "WRITE_SCOPE", "Operation", "scope_rules"]

READ_SCOPE: Final = "apikeys:read"
"""Reads the workspace's keys, identities, usage and audit trail."""
WRITE_SCOPE: Final = "apikeys:write"
"""Changes the workspace's keys, as a workspace user may."""
ADMIN_SCOPE: Final = "apikeys:admin"
"""Changes the workspace's identities; and, in an operator's workspace, every webhook."""


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation of the management API."""

    id: str
    method: str
    path: str
    scope: str
    summary: str
    status: int = 200
    answer: str = "Key"
    """The name of the answer's schema in the document's components."""
    body: dict[str, Any] | None = None
    body_required: bool = False
    query: tuple[tuple[str, dict[str, Any]], ...] = ()
    versioned: bool = False
    """Takes `If-Match` and answers with an `ETag` of what it read."""
    operators_only: bool = False
    """Answers only an operator's caller (`apikeys.api.webhooks`); any other caller is
    answered as on a path that is no operation."""

    @property
    def rule(self) -> str:
        return f"{self.method} {self.path}"


_PAGE: Final = (
    ("cursor", {"type": "string", "minLength": 1, "maxLength": 1000}),
    ("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
    ("state", {"type": "string", "enum": ["active", "disabled", "expired", "revoked"]}),
    ("identity", {"type": "string", "minLength": 1, "maxLength": 64}),
    ("environment", {"type": "string", "enum": ["live", "test"]}),
    ("owner", {"type": "string", "minLength": 1, "maxLength": 200}),
)


def _key_state(action: str, summary: str) -> Operation:
    return Operation(
        f"{action}_key",
        "POST",
        f"/keys/{{key_id}}/{action}",
        WRITE_SCOPE,
        summary,
        body=NO_BODY,
        versioned=True,
    )


def _identity_state(action: str, summary: str) -> Operation:
    return Operation(
        f"{action}_identity",
        "POST",
        f"/identities/{{identity_id}}/{action}",
        ADMIN_SCOPE,
        summary,
        answer="Identity",
        body=NO_BODY,
        versioned=True,
    )


OPERATIONS: Final[tuple[Operation, ...]] = (
    Operation(
        "create_key",
        "POST",
        "/keys",
        WRITE_SCOPE,
        "Create a key; the answer holds its secret, once",
        status=201,
        answer="CreatedKey",
        body=KEY_CREATE,
        body_required=True,
    ),
    Operation(
        "list_keys",
        "GET",
        "/keys",
        READ_SCOPE,
        "The workspace's keys",
        answer="KeyPage",
        query=_PAGE,
    ),
    Operation("get_key", "GET", "/keys/{key_id}", READ_SCOPE, "A key", versioned=True),
    Operation(
        "update_key",
        "PATCH",
        "/keys/{key_id}",
        WRITE_SCOPE,
        "Edit a key: only what is sent changes",
        body=KEY_UPDATE,
        body_required=True,
        versioned=True,
    ),
    Operation(
        "roll_key",
        "POST",
        "/keys/{key_id}/roll",
        WRITE_SCOPE,
        "Replace a key with a new one; the old one works through a grace period",
        status=201,
        answer="CreatedKey",
        body=ROLL,
        versioned=True,
    ),
    _key_state("disable", "Stop a key from authenticating until it is enabled"),
    _key_state("enable", "Let a disabled key authenticate again"),
    _key_state("revoke", "Revoke a key for good"),
    Operation(
        "key_usage",
        "GET",
        "/keys/{key_id}/usage",
        READ_SCOPE,
        "A key's requests per UTC day",
        answer="Usage",
        query=(("days", {"type": "integer", "minimum": 1, "maximum": 366}),),
    ),
    Operation(
        "audit",
        "GET",
        "/audit",
        READ_SCOPE,
        "A page of the audit trail of the caller's workspace and environment, newest last",
        answer="AuditPage",
        query=(("key_id", {"type": "string", "minLength": 1, "maxLength": 64}), *_PAGE[:2]),
    ),
    Operation(
        "create_identity",
        "POST",
        "/identities",
        ADMIN_SCOPE,
        "Create an identity",
        status=201,
        answer="Identity",
        body=IDENTITY_CREATE,
        body_required=True,
    ),
    Operation(
        "list_identities",
        "GET",
        "/identities",
        READ_SCOPE,
        "The workspace's identities",
        answer="IdentityPage",
        query=_PAGE[:2],
    ),
    Operation(
        "get_identity",
        "GET",
        "/identities/{identity_id}",
        READ_SCOPE,
        "An identity",
        answer="Identity",
        versioned=True,
    ),
    Operation(
        "update_identity",
        "PATCH",
        "/identities/{identity_id}",
        ADMIN_SCOPE,
        "Edit an identity",
        answer="Identity",
        body=IDENTITY_UPDATE,
        body_required=True,
        versioned=True,
    ),
    _identity_state("disable", "Turn an identity's keys off until it is enabled"),
    _identity_state("enable", "Turn a disabled identity on again"),
    _identity_state("revoke", "Turn an identity off for good"),
    # Before `/webhooks/{webhook_id}`, which `/webhooks/deliveries` would match too.
    Operation(
        "list_webhook_deliveries",
        "GET",
        "/webhooks/deliveries",
        ADMIN_SCOPE,
        "A page of the webhook deliveries of every workspace, newest first",
        answer="DeliveryPage",
        query=(
            ("cursor", {"type": "string", "minLength": 1, "maxLength": 1000}),
            ("status", {"type": "string", "enum": ["pending", "delivered", "failed"]}),
            ("workspace", {"type": "string", "minLength": 1, "maxLength": 200}),
            ("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
        ),
        operators_only=True,
    ),
    Operation(
        "get_webhook_delivery",
        "GET",
        "/webhooks/deliveries/{delivery_id}",
        ADMIN_SCOPE,
        "A webhook delivery",
        answer="Delivery",
        operators_only=True,
    ),
    Operation(
        "replay_webhook_delivery",
        "POST",
        "/webhooks/deliveries/{delivery_id}/replay",
        ADMIN_SCOPE,
        "Send a delivery again (same id and body), after any earlier one for its key",
        answer="Delivery",
        body=NO_BODY,
        operators_only=True,
    ),
    Operation(
        "create_webhook",
        "POST",
        "/webhooks",
        ADMIN_SCOPE,
        "Add a webhook endpoint; the answer holds its signing secret, once",
        status=201,
        answer="CreatedWebhook",
        body=WEBHOOK_CREATE,
        body_required=True,
        operators_only=True,
    ),
    Operation(
        "list_webhooks",
        "GET",
        "/webhooks",
        ADMIN_SCOPE,
        "The webhook endpoints of every workspace, oldest first",
        answer="Webhooks",
        operators_only=True,
    ),
    Operation(
        "get_webhook",
        "GET",
        "/webhooks/{webhook_id}",
        ADMIN_SCOPE,
        "A webhook endpoint",
        answer="Webhook",
        operators_only=True,
    ),
    Operation(
        "remove_webhook",
        "DELETE",
        "/webhooks/{webhook_id}",
        ADMIN_SCOPE,
        "Remove a webhook endpoint and its deliveries",
        answer="Webhook",
        operators_only=True,
    ),
    Operation(
        "roll_webhook_secret",
        "POST",
        "/webhooks/{webhook_id}/roll",
        ADMIN_SCOPE,
        "Give an endpoint a new signing secret, shown once; the old one signs too "
        "through the overlap",
        answer="CreatedWebhook",
        body=WEBHOOK_ROLL,
        operators_only=True,
    ),
)
"""Every operation, in the document's order."""


def scope_rules() -> dict[str, str]:
    """The route table of the scopes each operation needs (`APIKeyMiddleware(scopes=…)`),
    relative to where the API is mounted. A path or method that is no operation needs
    `apikeys:read`, so that it answers 404 or 405 rather than 403 to a reader; so does an
    operation for operators only (it has no rule of its own), which answers everyone else
    as such a path does."""
    rules = {
        operation.rule: operation.scope for operation in OPERATIONS if not operation.operators_only
    }
    rules["* /{rest:path}"] = READ_SCOPE
    return rules
