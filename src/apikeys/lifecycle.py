"""The rules of a key's life: whether a key may be used, and which changes it may take.

`TRANSITIONS` is the one table of what each action does to a key's stored state:

| action    | from               | to                             |
|-----------|--------------------|--------------------------------|
| `disable` | active             | disabled                       |
| `enable`  | disabled           | active                         |
| `revoke`  | active, disabled   | revoked                        |
| `roll`    | active             | the same state (a successor)   |
| `update`  | active, disabled   | the same state (fields edited) |

An action on a key already in its target state changes nothing and is not refused. The
manager, the command line, the settings page and the stores read the table here:
`refusal` says why an action is refused (with the rolled-key rules the states do not show),
`may_take` is the check a store makes in the atomic step that applies a change (the
memory store calls it; the SQL store's `WHERE` and the Redis scripts' `EDITABLE` are made
from the table), and `offered` says whether the page offers an action. `check_usable` is
the one check of whether a key may authenticate a request, and `check_identity_usable` the
one check of its identity's part in that (a key of a disabled or revoked identity is
refused as a disabled or revoked key).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, NamedTuple

from apikeys.errors import KeyDisabled, KeyExpired, KeyRevoked
from apikeys.types import ACTIVE, DISABLED, EXPIRED, REVOKED, KeyRecord, StoredState, utcnow

if TYPE_CHECKING:
    from apikeys.identities import IdentityRecord

__all__ = [
    "TRANSITIONS",
    "Transition",
    "check_identity_usable",
    "check_usable",
    "may_take",
    "offered",
    "refusal",
]


class Transition(NamedTuple):
    """What an action does to a key's stored state: the states it takes a key from, and
    the state it leaves it in (None: the key keeps its state)."""

    sources: tuple[StoredState, ...]
    target: StoredState | None


TRANSITIONS: Final[Mapping[str, Transition]] = MappingProxyType(
    {
        "disable": Transition((ACTIVE,), DISABLED),
        "enable": Transition((DISABLED,), ACTIVE),
        "revoke": Transition((ACTIVE, DISABLED), REVOKED),
        "roll": Transition((ACTIVE,), None),
        "update": Transition((ACTIVE, DISABLED), None),
    }
)
"""Each action's `Transition`: the table in this module's docstring."""

# Why an action is refused for a key in a state it may not take it from.
_STATE_REFUSALS: Final[Mapping[StoredState, str]] = MappingProxyType(
    {REVOKED: "it is revoked", DISABLED: "it is disabled: enable it first"}
)


def check_usable(record: KeyRecord, now: datetime | None = None) -> None:
    """Raise the matching error unless `record` may authenticate a request at `now`.

    Revoked wins over disabled, and disabled over expired (`KeyRecord.status_at`), so the
    answer never depends on the time when a person has acted on the key.
    """
    state = record.state
    if state != ACTIVE:
        raise KeyRevoked() if state == REVOKED else KeyDisabled()
    if record.expires_at is not None and record.expires_at <= (now or utcnow()):
        raise KeyExpired()


_IDENTITY_DISABLED: Final = "The API key's identity is disabled."
_IDENTITY_REVOKED: Final = "The API key's identity was revoked."
_IDENTITY_GONE: Final = "The API key's identity no longer exists."


def check_identity_usable(identity: IdentityRecord | None) -> IdentityRecord:
    """`identity` (the identity a usable key belongs to) if its keys may authenticate
    requests; else the refusal of a key in that state: `KeyDisabled` for a disabled
    identity, `KeyRevoked` for a revoked one or one that is gone (None: its row or hash
    was deleted by hand), each saying that it is the identity's doing. Nothing is written
    on the keys: enabling the identity makes them usable again (a key revoked on its own
    is refused by `check_usable` first, whatever its identity)."""
    if identity is None:
        raise KeyRevoked(_IDENTITY_GONE)
    state = identity.state
    if state != ACTIVE:
        raise KeyRevoked(_IDENTITY_REVOKED) if state == REVOKED else KeyDisabled(_IDENTITY_DISABLED)
    return identity


def may_take(state: StoredState, action: str) -> bool:
    """True when a key whose stored state is `state` may take `action` and would change:
    the check a store makes in the one atomic step that applies a state change
    (`KeyStore.set_state`), so that a change made meanwhile by another process is never
    overwritten (a revoked key is never enabled)."""
    return state in TRANSITIONS[action].sources


def refusal(record: KeyRecord, action: str) -> str | None:
    """Why `action` (`roll`, `disable`, `enable`, `revoke`, `update`) may not be taken on
    `record`, or None when it may: the manager, the command line and the settings page all
    ask this.

    Beside the states of `TRANSITIONS` (a revoked key takes no action but `revoke`, which
    then changes nothing; a disabled key is enabled before it is rolled):

    - A rolled key (`replaced_by` set) is not rolled again, so a key never has two live
      successors; roll its successor instead. Nor is it disabled while active: it stops
      working when its grace period ends, and `revoke` stops it now.
    """
    sources, target = TRANSITIONS[action]
    state = record.state
    if state not in sources and state != target:
        return _STATE_REFUSALS[state]
    if record.replaced_by is not None:
        if action == "roll":
            return f"it was rolled already: roll the key that replaces it, {record.replaced_by}"
        if action == "disable" and record.status == ACTIVE:
            return (
                "it was rolled: it stops working when its grace period ends (revoke it to "
                "stop it now)"
            )
    return None


def offered(record: KeyRecord, action: str, now: datetime) -> bool:
    """True when `action` is allowed on `record` and changes it: what the settings page
    offers. An expired key is not offered Roll or Disable: its expiry is the operator's to
    move, and a roll would move it; disabled, it would still refuse every request as it
    does."""
    target = TRANSITIONS[action].target
    if target is not None and record.state == target:
        return False
    if action in ("roll", "disable") and record.status_at(now) == EXPIRED:
        return False
    return refusal(record, action) is None
