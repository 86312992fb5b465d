"""The rules of a key's life: whether a key may be used, and which transitions it may take.

`check_usable` is the one check of a key's state and expiry, and `refusal` the one table of
its transitions; the manager, the request path, the command line and the settings page read
them here.
"""

from __future__ import annotations

from datetime import datetime

from apikeys.errors import KeyDisabled, KeyExpired, KeyRevoked
from apikeys.types import ACTIVE, DISABLED, REVOKED, KeyRecord, utcnow

__all__ = ["check_usable", "refusal"]


def check_usable(record: KeyRecord, now: datetime | None = None) -> None:
    """Raise the matching error unless `record` may authenticate a request at `now`.

    Revoked wins over disabled, and disabled over expired, so the answer never depends on
    the time when a person has acted on the key.
    """
    state = record.state
    if state != ACTIVE:
        raise KeyRevoked() if state == REVOKED else KeyDisabled()
    if record.expires_at is not None and record.expires_at <= (now or utcnow()):
        raise KeyExpired()


def refusal(record: KeyRecord, action: str) -> str | None:
    """Why `action` (`roll`, `disable`, `enable`, `revoke`) may not be taken on `record`, or
    None when it may: the one table of a key's transitions that the manager, the command
    line and the settings page all read.

    - A revoked key takes no transition but `revoke` (which then changes nothing).
    - A disabled key is enabled before it is rolled: a roll never makes an active key out of
      a disabled one.
    - A rolled key (`replaced_by` set) is not rolled again, so a key never has two live
      successors; roll its successor instead. Nor is it disabled while active: it stops
      working when its grace period ends, and `revoke` stops it now.
    """
    if action == "revoke":
        return None
    if record.state == REVOKED:
        return "it is revoked"
    if action == "roll":
        if record.state == DISABLED:
            return "it is disabled: enable it first"
        if record.replaced_by is not None:
            return f"it was rolled already: roll the key that replaces it, {record.replaced_by}"
    if action == "disable" and record.replaced_by is not None and record.status == "active":
        return (
            "it was rolled: it stops working when its grace period ends (revoke it to stop it now)"
        )
    return None
