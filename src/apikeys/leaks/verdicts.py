"""One rule for a token reported as leaked: act only on a key whose secret is right.

A key id is public (it is in every log line and audit event), so a token with a real id
and a made-up secret must never get that key revoked: the secret is checked with the
manager's `verify` first, which costs the same hash work whether the id exists or not.
A key already revoked, disabled or expired still has a real secret: it is confirmed, and
revoked (or disabled) unless it already is.
"""

from __future__ import annotations

import logging
from typing import Literal

from apikeys.errors import (
    InvalidAPIKey,
    InvalidTransition,
    KeyDisabled,
    KeyExpired,
    KeyNotFound,
    KeyRevoked,
    MalformedAPIKey,
)
from apikeys.keys import parse_key_of
from apikeys.manager import KeyManager

__all__ = ["LEAK_ACTIONS", "LeakAction", "Outcome", "act_on_leak"]

logger = logging.getLogger("apikeys.leaks")

LeakAction = Literal["revoke", "disable"]
LEAK_ACTIONS: tuple[LeakAction, ...] = ("revoke", "disable")
"""What a confirmed leaked key gets: revoked for good, or disabled until someone enables it."""

Outcome = Literal[
    "not confirmed",
    "revoked",
    "disabled",
    "already revoked",
    "already disabled",
    "changed meanwhile",
]
"""`not confirmed`: not one of this manager's keys, or a wrong secret. Every other outcome
is a confirmed leak."""


async def act_on_leak(
    manager: KeyManager, token: str, *, action: LeakAction = "revoke", actor: str
) -> Outcome:
    """Revoke (`leak_revoked` in the audit trail) or disable (reason `leaked`) the key
    `token` names, if its secret is right; what happened.

    Only keys with the manager's prefix are looked at. Raises `AuthUnavailable` when the
    key store cannot be reached; nothing else.
    """
    try:
        parsed = parse_key_of(token, manager.prefix)
    except MalformedAPIKey:
        return "not confirmed"  # the shape or the checksum is wrong: no store lookup
    state = "active"
    try:
        await manager.verify(token, record_usage=False)
    except InvalidAPIKey:
        return "not confirmed"
    except KeyRevoked:
        state = "revoked"
    except KeyDisabled:
        state = "disabled"
    except KeyExpired:
        pass  # expired, but its secret is real: revoked or disabled all the same
    if state == "revoked" or (state == "disabled" and action == "disable"):
        return "already revoked" if state == "revoked" else "already disabled"
    try:
        if action == "disable":
            await manager.disable(parsed.id, actor=actor, reason="leaked")
        else:
            await manager.revoke(parsed.id, actor=actor, leaked=True)
    except (InvalidTransition, KeyNotFound):
        return "changed meanwhile"  # revoked (or deleted) by someone else just now
    outcome: Outcome = "disabled" if action == "disable" else "revoked"
    logger.warning("key.%s key=%s actor=%s", outcome, parsed.masked, actor)
    return outcome
