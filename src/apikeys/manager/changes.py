"""Issuing and changing keys: create, the state transitions (disable, enable, revoke),
update, roll and the balance a roll moves, and spending credits. Which transitions a key may
take is `apikeys.lifecycle.refusal`."""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, Final

from apikeys.errors import (
    ChangeNotConfirmed,
    DuplicateKeyId,
    InvalidKeyParameters,
    InvalidTransition,
    KeyNotFound,
)
from apikeys.fields import KEY_FIELDS
from apikeys.keys import (
    environment_prefix,
    generate_key,
)
from apikeys.lifecycle import TRANSITIONS, refusal
from apikeys.manager.construction import logger
from apikeys.manager.credits import refill_window
from apikeys.manager.identities import IdentityManagement
from apikeys.manager.reading import KeyReading
from apikeys.policies import POLICY_PARSERS, check_text, parse_refill, policy_fields
from apikeys.ratelimit import format_policies, parse_policies
from apikeys.scopes import validate_scopes
from apikeys.stores.contract import MAX_ROLL_HOPS
from apikeys.types import (
    ACTIVE,
    LIVE,
    REVOKED,
    AuditAction,
    AuditEvent,
    CreatedKey,
    Environment,
    KeyRecord,
    StoredKey,
    jsonable,
    utcnow,
)

__all__ = ["UNSET", "KeyChanges"]

_INSERT_ATTEMPTS = 5


class _Unset:
    """The default of `update`'s arguments for which None means something."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()


def _rate_limit(rate_limit: str | None, rate_limits: Mapping[str, str] | None) -> str | None:
    """The `rate_limit` text to store: given as text, or made from a `{name: limit}` map."""
    if rate_limits is not None:
        if rate_limit is not None:
            raise InvalidKeyParameters("pass rate_limit or rate_limits, not both")
        if not isinstance(rate_limits, Mapping):
            raise InvalidKeyParameters("rate_limits takes a mapping of policy names to limits")
        return format_policies(rate_limits)
    if rate_limit is not None:
        parse_policies(rate_limit)
    return rate_limit


def _access_change(scopes: Iterable[str] | None, full_access: bool | None) -> dict[str, object]:
    """`update`'s access and scopes: full access, or restricted to at least one scope."""
    if full_access is None and scopes is None:
        return {}
    scope_tuple = validate_scopes(scopes or ())
    if full_access and scope_tuple:
        raise InvalidKeyParameters("a full-access key takes no scopes")
    if full_access:
        return {"access": "full", "scopes": ()}
    if not scope_tuple:
        raise InvalidKeyParameters(
            "a restricted key needs at least one scope (or pass full_access=True)"
        )
    return {"access": "restricted", "scopes": scope_tuple}


def _rate_limit_change(
    rate_limit: str | _Unset | None, rate_limits: Mapping[str, str] | None
) -> dict[str, object]:
    if rate_limits is not None:
        if not isinstance(rate_limit, _Unset):
            raise InvalidKeyParameters("pass rate_limit or rate_limits, not both")
        return {"rate_limit": _rate_limit(None, rate_limits)}
    if isinstance(rate_limit, _Unset):
        return {}
    return {"rate_limit": _rate_limit(rate_limit, None)}


def _policy_changes(given: Mapping[str, object]) -> dict[str, object]:
    """The policy fields `update` was given (`UNSET`: not given), each through its parser
    (`POLICY_PARSERS`); None clears one (its default in `RECORD_FIELDS`: no owner, no
    metadata, any address, unlimited credits, no refill)."""
    return {
        field: KEY_FIELDS[field].empty() if value is None else POLICY_PARSERS[field](value)
        for field, value in given.items()
        if not isinstance(value, _Unset)
    }


def _start_refill(changes: dict[str, object], now: datetime) -> None:
    """A refill set by `changes` starts now: full, unless `credits` says otherwise."""
    if changes.get("credit_refill") is None:
        return
    refill = parse_refill(str(changes["credit_refill"]))
    if refill is not None:
        if changes.get("credits") is None:
            changes["credits"] = refill.amount
        changes["credits_refilled_at"] = refill.period_start(now)


# The fields of a key's balance: a rolled key has none of its own (see `roll`).
_BALANCE_FIELDS: Final = frozenset({"credits", "credit_refill", "credits_refilled_at"})


def _expiry(
    now: datetime, expires_at: datetime | None, expires_in: timedelta | None
) -> datetime | None:
    if expires_at is not None and expires_in is not None:
        raise InvalidKeyParameters("pass expires_at or expires_in, not both")
    if expires_in is not None:
        if expires_in <= timedelta(0):
            raise InvalidKeyParameters("expires_in must be positive")
        try:
            return now + expires_in
        except OverflowError:  # past the year 9999
            raise InvalidKeyParameters("expires_in ends after the year 9999") from None
    if expires_at is not None:
        if expires_at.tzinfo is None:
            raise InvalidKeyParameters("expires_at must be timezone-aware")
        if expires_at <= now:
            raise InvalidKeyParameters("expires_at must be in the future")
    return expires_at


class KeyChanges(KeyReading, IdentityManagement):
    """The changes a `KeyManager` makes: each one written with its audit event, announced,
    and seen by every process on its next request."""

    async def create(
        self,
        *,
        name: str,
        workspace: str = "default",
        scopes: Iterable[str] = (),
        full_access: bool = False,
        rate_limit: str | None = None,
        rate_limits: Mapping[str, str] | None = None,
        expires_at: datetime | None = None,
        expires_in: timedelta | None = None,
        owner: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        allowed_ips: Iterable[str] | None = None,
        credits: int | None = None,
        credit_refill: str | None = None,
        environment: Environment = LIVE,
        identity: str | None = None,
        actor: str | None = None,
    ) -> CreatedKey:
        """Create a key. The returned `CreatedKey.key` is the only time the key is shown.

        `identity` makes it one of that identity's keys (`create_identity`): one that
        exists in `workspace` and is not revoked, else `InvalidKeyParameters`.

        `environment` is `live` (the default) or `test`: the key's token starts with it
        (`ak_live_…`, `ak_test_…`), the application reads it as
        `scope["apikey"].environment`, and it never changes (a roll keeps it).

        A key has `full_access` (every scope, including scopes added later) or the given
        `scopes`; a restricted key without scopes is refused. `rate_limit` overrides the
        middleware's default: one limit in `limits` notation (`100/minute`) or named
        policies (`burst=10/second, daily=10000/day`); `rate_limits={"burst": "10/second",
        …}` says the same as a mapping (stored as that text). Expiry is `expires_at` or
        `expires_in`.

        Policies (`apikeys.policies`): `owner` and `metadata` (a JSON object of at most
        4 KiB, never a secret) for the application; `allowed_ips`, CIDR ranges the key may
        be used from; `credits`, uses left, with `credit_refill` (`"1000/day"`,
        `"5000/month"`) setting them back each UTC period (a key with a refill and no
        `credits` starts full).

        A key the store made but its replicas did not confirm in time (Redis `wait_replicas`)
        is returned all the same, with `CreatedKey.confirmed` False and the reason in
        `CreatedKey.warning`: it works, and this is the only time it can be shown.
        """
        check_text(name, "name")
        check_text(workspace, "workspace")
        environment_prefix(self.prefix, environment)  # InvalidKeyParameters unless one
        scope_tuple = validate_scopes(scopes)
        if full_access and scope_tuple:
            raise InvalidKeyParameters("a full-access key takes no scopes")
        if not full_access and not scope_tuple:
            raise InvalidKeyParameters(
                "a restricted key needs at least one scope (or pass full_access=True)"
            )
        rate_limit = _rate_limit(rate_limit, rate_limits)
        now = utcnow()
        expiry = _expiry(now, expires_at, expires_in)
        # The policy arguments, by field: each field of `POLICY_PARSERS` is one.
        policy = policy_fields(
            **{field: value for field, value in locals().items() if field in POLICY_PARSERS}
        )
        refill = parse_refill(policy.get("credit_refill"))
        if refill is not None:
            policy.setdefault("credits", refill.amount)
            policy["credits_refilled_at"] = refill.period_start(now)
        if identity is not None:
            policy["identity"] = await self.check_identity(identity, workspace)
        return await self._issue(
            name=name,
            workspace=workspace,
            access="full" if full_access else "restricted",
            scopes=scope_tuple,
            rate_limit=rate_limit,
            created_at=now,
            expires_at=expiry,
            policy=policy,
            environment=environment,
            actor=actor,
        )

    @staticmethod
    def _expiry_change(
        expires_at: datetime | _Unset | None, expires_in: timedelta | None
    ) -> dict[str, object]:
        """`update`'s expiry: None never expires; `expires_in` counts from now."""
        if expires_in is None and isinstance(expires_at, _Unset):
            return {}
        given = None if isinstance(expires_at, _Unset) else expires_at
        if given is None and expires_in is None:
            return {"expires_at": None}
        return {"expires_at": _expiry(utcnow(), given, expires_in)}

    async def _issue(
        self,
        *,
        name: str,
        workspace: str,
        access: str,
        scopes: tuple[str, ...],
        rate_limit: str | None,
        created_at: datetime,
        expires_at: datetime | None,
        replaces: str | None = None,
        policy: Mapping[str, Any] | None = None,
        environment: Environment = LIVE,
        actor: str | None = None,
    ) -> CreatedKey:
        self._use()
        for _ in range(_INSERT_ATTEMPTS):
            parsed = generate_key(self.prefix, environment=environment)
            record = KeyRecord(
                id=parsed.id,
                name=name,
                workspace=workspace,
                prefix=parsed.masked,
                access="full" if access == "full" else "restricted",
                scopes=scopes,
                state=ACTIVE,
                rate_limit=rate_limit,
                created_at=created_at,
                expires_at=expires_at,
                replaces=replaces,
                environment=environment,
                **(policy or {}),
            )
            # What the key was made with: its grants and policies, never its secret.
            made = record.to_dict()
            for volatile in (
                "id",
                "prefix",
                "status",
                "last_used_at",
                "request_count",
                "workspace",
                "created_at",
                "rate_limits",  # derived from rate_limit
            ):
                made.pop(volatile)
            event = AuditEvent(
                time=created_at,
                key_id=record.id,
                workspace=workspace,
                action="created",
                actor=actor,
                changes={k: v for k, v in made.items() if v not in (None, [], {})},
            )
            warning = None
            try:
                secret_hash = await self.hasher.ahash(parsed.secret)
                await self.store.insert(StoredKey(record, secret_hash), event=event)
            except DuplicateKeyId:
                continue
            except ChangeNotConfirmed as exc:
                # Made on the primary, not confirmed by its replicas: the key works, and
                # this is the only time it can be shown. Return it, saying so.
                stored = await self.store.get(record.id)
                if stored is None or stored.secret_hash != secret_hash:
                    continue  # nothing of ours was stored: the id was taken
                warning = str(exc)
                logger.warning("apikeys: key %s created, not confirmed: %s", record.id, warning)
            self._announce(event)
            return CreatedKey(parsed.token, record, warning)
        raise DuplicateKeyId("could not find a free key id")  # pragma: no cover

    async def add_imported(
        self,
        record: KeyRecord,
        secret_hash: str,
        *,
        source: str,
        scheme: str,
        actor: str | None = None,
        at: datetime | None = None,
    ) -> None:
        """Add a key another system issued, as `apikeys.importing.import_keys` does: its
        `record`, and the hash it is checked with (`secret_hash`, its old hash as the store
        keeps it). Written with its `imported` audit event, which names the old system
        (`source`) and its hash's `scheme`, never the hash, and announced like `create`'s.
        Raises `DuplicateKeyId` when the id is taken.
        """
        self._use()
        event = AuditEvent(
            time=at or utcnow(),
            key_id=record.id,
            workspace=record.workspace,
            action="imported",
            actor=actor,
            changes={
                "name": record.name,
                "access": record.access,
                "scopes": list(record.scopes),
                "state": record.state,
                "environment": record.environment,
                "imported_from": source,
                "scheme": scheme,
            },
        )
        await self.store.insert(StoredKey(record, secret_hash), event=event)
        self._announce(event)

    async def disable(
        self, key_id: str, *, actor: str | None = None, reason: str | None = None
    ) -> KeyRecord:
        """Stop a key from authenticating until `enable`. Refused for a revoked key.

        Every change takes an `actor` (who made it) for the audit trail; `reason` is noted
        in the event's changes (the leak responder says `"leaked"`).
        """
        return await self._transition(key_id, "disable", "disabled", actor, reason)

    async def enable(self, key_id: str, *, actor: str | None = None) -> KeyRecord:
        """Let a disabled key authenticate again. Refused for a revoked key."""
        return await self._transition(key_id, "enable", "enabled", actor)

    async def revoke(
        self, key_id: str, *, actor: str | None = None, leaked: bool = False
    ) -> KeyRecord:
        """Revoke a key for good: every later request with it gets 401 `key_revoked`.

        `leaked=True` records the revocation as `leak_revoked` in the audit trail.
        """
        action: AuditAction = "leak_revoked" if leaked else "revoked"
        return await self._transition(key_id, "revoke", action, actor)

    async def _transition(
        self,
        key_id: str,
        verb: str,
        action: AuditAction,
        actor: str | None,
        reason: str | None = None,
    ) -> KeyRecord:
        """Take the state change `verb` of `TRANSITIONS` (`disable`, `enable`, `revoke`)."""
        allowed_from, target = TRANSITIONS[verb]
        if target is None:
            raise ValueError(f"{verb} is not a change of state")
        changes: dict[str, Any] = {"state": target}
        if reason is not None:
            changes["reason"] = reason
        before = await self.store.get(key_id)
        if before is None:
            raise KeyNotFound(key_id)
        why = refusal(before.record, verb)  # None for a key in `target` already
        if why is not None:
            raise InvalidTransition(key_id, before.record.status, verb, why)
        event = await self._event(action, key_id, actor, changes, before.record.workspace)
        record = await self._change(
            key_id,
            lambda notice: self.store.set_state(
                key_id,
                target,
                allowed_from=allowed_from,
                at=event.time,
                notice=notice,
                event=event,
            ),
        )
        if record.state != target:
            raise InvalidTransition(key_id, record.status, verb)
        if before.record.state != target:
            self._announce(event)
        return self.usage_buffer.apply(record)

    async def update(
        self,
        key_id: str,
        *,
        name: str | None = None,
        scopes: Iterable[str] | None = None,
        full_access: bool | None = None,
        rate_limit: str | _Unset | None = UNSET,
        rate_limits: Mapping[str, str] | None = None,
        expires_at: datetime | _Unset | None = UNSET,
        expires_in: timedelta | None = None,
        owner: str | _Unset | None = UNSET,
        metadata: Mapping[str, Any] | _Unset | None = UNSET,
        allowed_ips: Iterable[str] | _Unset | None = UNSET,
        credits: int | _Unset | None = UNSET,
        credit_refill: str | _Unset | None = UNSET,
        identity: str | _Unset | None = UNSET,
        actor: str | None = None,
    ) -> KeyRecord:
        """Edit a key: its name, access and scopes, rate limit or expiry, and its policies
        (None clears `owner`, `metadata`, `allowed_ips` and `credit_refill`, and makes
        `credits` unlimited). Refused when revoked. `identity` moves the key to another
        identity of its workspace (not a revoked one), or out of any (None).

        Only what is given changes. `scopes=[…]` makes the key restricted to those scopes;
        `full_access=True` gives it every scope; `rate_limit=None` returns it to the
        middleware's default (`rate_limits={name: limit}` sets named policies) and
        `expires_at=None` makes it never expire (`expires_in` sets an expiry from now). Like
        `revoke`, it returns once every process that caches keys has dropped the old
        record: a narrowed key is narrowed on its very next request.
        """
        # The policy arguments, by field: each field of `POLICY_PARSERS` is one.
        policies = {field: value for field, value in locals().items() if field in POLICY_PARSERS}
        changes: dict[str, object] = {} if name is None else {"name": check_text(name, "name")}
        changes.update(_access_change(scopes, full_access))
        changes.update(_rate_limit_change(rate_limit, rate_limits))
        changes.update(self._expiry_change(expires_at, expires_in))
        changes.update(_policy_changes(policies))
        if _BALANCE_FIELDS & changes.keys():
            await self._check_own_balance(key_id, changes)
        if not isinstance(identity, _Unset):
            changes["identity"] = await self._identity_change(key_id, identity)
        _start_refill(changes, utcnow())
        # An update that changes nothing is no event on any store (nor a webhook).
        event = await self._event("updated", key_id, actor, changes) if changes else None
        record = await self._change(
            key_id, lambda notice: self.store.update(key_id, changes, notice=notice, event=event)
        )
        if record.state == REVOKED:
            raise InvalidTransition(key_id, REVOKED, "update")
        if event is not None:
            self._announce(event)
        if _BALANCE_FIELDS & changes.keys() and record.replaces is not None:
            await self._share_with_predecessors(record, actor)
        # As `get` shows it: a rolled key with the balance it spends from, its successor's.
        return self.usage_buffer.apply(await self._shared_credits(record, {}))

    async def _identity_change(self, key_id: str, identity: str | None) -> str | None:
        """The identity `update` moves the key to, checked in the key's workspace."""
        if identity is None:
            return None
        stored = await self.store.get(key_id)
        if stored is None:
            raise KeyNotFound(key_id)
        return await self.check_identity(identity, stored.record.workspace)

    async def _share_with_predecessors(self, record: KeyRecord, actor: str | None) -> None:
        """Copy `record`'s credit settings to the keys it replaces, which spend its balance:
        whether a request is charged is read from the key's own record, and a refill follows
        the spending key's `credit_refill`."""
        changes = {"credits": record.credits, "credit_refill": record.credit_refill}
        successor = record
        for _ in range(MAX_ROLL_HOPS):
            if successor.replaces is None:
                return
            stored = await self.store.get(successor.replaces)
            if stored is None or stored.record.replaced_by != successor.id:
                return
            key_id = stored.record.id
            event = await self._event(
                "updated",
                key_id,
                actor,
                {**changes, "reason": f"the credits of {record.id}, which it spends"},
                stored.record.workspace,
            )
            successor = await self._change(
                key_id,
                lambda notice: self.store.update(key_id, changes, notice=notice, event=event),  # noqa: B023
            )
            if successor.state != REVOKED:
                self._announce(event)

    async def _check_own_balance(self, key_id: str, changes: dict[str, object]) -> None:
        """Refuse to change the credits of a rolled key: its balance is its successor's.

        Credit settings given as they are (a form sent back unchanged) are dropped from
        `changes` instead.
        """
        stored = await self.store.get(key_id)
        if stored is None:
            raise KeyNotFound(key_id)
        record = stored.record
        if record.replaced_by is None or record.state == REVOKED:
            return
        shown = await self._shared_credits(record, {})
        for field in _BALANCE_FIELDS & changes.keys():
            if changes[field] == getattr(shown, field):
                del changes[field]
        if _BALANCE_FIELDS & changes.keys():
            raise InvalidTransition(
                key_id,
                record.status,
                "update",
                "it was rolled: it spends the credits of the key that replaces it, "
                f"{record.replaced_by}; change them there",
            )

    async def roll(
        self,
        key_id: str,
        grace: timedelta = timedelta(hours=24),
        *,
        expires_in: timedelta | None = None,
        expires_at: datetime | None = None,
        actor: str | None = None,
    ) -> CreatedKey:
        """Replace a key with a new one of the same name, workspace, access, scopes and limit.

        The old key keeps working for `grace`, then expires (an earlier expiry stays). The
        new key keeps the old one's lifetime: it expires as long after now as the old one
        did after its creation (a key that never expired gives one that never does), unless
        `expires_in` or `expires_at` says otherwise. Refused for a revoked or disabled key,
        and for one rolled already (roll its successor): see `refusal`.

        The pair has one balance of credits: the new key takes over what the old one had
        left, and the old key spends from the new key's balance through its grace period.

        As with `create`, a roll its store's replicas did not confirm in time still returns
        the new key, with `CreatedKey.confirmed` False and the reason in `warning`.
        """
        if grace < timedelta(0):
            raise InvalidKeyParameters("grace must not be negative")
        self._use()
        stored = await self.store.get(key_id)
        if stored is None:
            raise KeyNotFound(key_id)
        old = stored.record
        why = refusal(old, "roll")
        if why is not None:
            raise InvalidTransition(key_id, old.status, "roll", why)
        now = utcnow()
        if expires_in is None and expires_at is None and old.expires_at is not None:
            # The same lifetime as the key it replaces, from now (at least a second).
            expires_in = max(old.expires_at - old.created_at, timedelta(seconds=1))
        created = await self._issue(
            name=old.name,
            workspace=old.workspace,
            access=old.access,
            scopes=old.scopes,
            rate_limit=old.rate_limit,
            created_at=now,
            expires_at=_expiry(now, expires_at, expires_in),
            replaces=key_id,
            policy={
                **{field: getattr(old, field) for field in POLICY_PARSERS},
                # One balance for the pair: the new key starts empty and is given the old
                # key's credits once the old key spends from it (below).
                "credits": None if old.credits is None else 0,
                "credits_refilled_at": old.credits_refilled_at,
                "identity": old.identity,
            },
            environment=old.environment,
            actor=actor,
        )
        # The new key exists before the old one is cut short: a failure here never leaves
        # the integration without a working key.
        new_id = created.record.id
        rolled = AuditEvent(
            time=now,
            key_id=key_id,
            workspace=old.workspace,
            action="rolled",
            actor=actor,
            changes=jsonable({"replaced_by": new_id, "grace_ends_at": now + grace}),
        )
        warnings = [created.warning] if created.warning else []
        old = await self._unconfirmed(
            key_id,
            self._change(
                key_id,
                lambda notice: self.store.shorten_expiry(
                    key_id, now + grace, replaced_by=new_id, notice=notice, event=rolled
                ),
            ),
            warnings,
        )
        if old.state == REVOKED or old.replaced_by != new_id:
            # Revoked elsewhere while the new key was being issued (revocation wins), or
            # rolled by another call at the same time (the first to link the key wins): the
            # new key never served and is revoked, so one key never has two live successors.
            reason = (
                "the key it replaces was revoked"
                if old.state == REVOKED
                else "the key it replaces was rolled by another call at the same time"
            )
            await self._change(
                new_id,
                lambda notice: self.store.set_state(
                    new_id,
                    REVOKED,
                    allowed_from=TRANSITIONS["revoke"].sources,
                    at=utcnow(),
                    notice=notice,
                    event=AuditEvent(
                        time=utcnow(),
                        key_id=new_id,
                        workspace=old.workspace,
                        action="revoked",
                        actor=actor,
                        changes={"state": REVOKED, "reason": reason},
                    ),
                ),
            )
            if old.state == REVOKED:
                raise InvalidTransition(key_id, REVOKED, "roll")
            why = refusal(old, "roll")
            raise InvalidTransition(key_id, old.status, "roll", why or "it was rolled already")
        self._announce(rolled)
        record = created.record
        if old.credits is not None or record.credits is not None:
            record = await self._unconfirmed(
                new_id, self._move_balance(old, new_id, actor), warnings
            )
        return CreatedKey(created.key, record, warnings[0] if warnings else None)

    async def _unconfirmed(
        self, key_id: str, change: Awaitable[KeyRecord], warnings: builtins.list[str]
    ) -> KeyRecord:
        """`change`'s record. A change its replicas did not confirm (`ChangeNotConfirmed`)
        was made all the same: the key's record as the store has it, and why in `warnings`.
        For the steps of a roll after its new key exists, which must not lose that key."""
        try:
            return await change
        except ChangeNotConfirmed as exc:
            stored = await self.store.get(key_id)
            if stored is None:
                raise
            warnings.append(str(exc))
            return stored.record

    async def _move_balance(self, old: KeyRecord, new_id: str, actor: str | None) -> KeyRecord:
        """Give the new key of a roll the old key's credits, as they were when the old key
        began to spend from the new one's balance (`old`, as `shorten_expiry` returned it).

        Spends of the old key taken before the link are in `old.credits`; those after it are
        taken from the new key (which holds none until this: they are refused for that
        moment, never admitted twice). So the pair spends one balance, never a copy.
        """
        changes = {"credits": old.credits, "credits_refilled_at": old.credits_refilled_at}
        event = AuditEvent(
            time=utcnow(),
            key_id=new_id,
            workspace=old.workspace,
            action="updated",
            actor=actor,
            changes=jsonable({**changes, "reason": f"the credits of {old.id}, which it replaces"}),
        )
        record = await self._change(
            new_id,
            lambda notice: self.store.update(new_id, changes, notice=notice, event=event),
            wait=False,  # it only widens the key
        )
        if record.state != REVOKED:
            self._announce(event)
        return record

    async def spend_credits(self, record: KeyRecord, cost: int = 1) -> int | None:
        """Take `cost` of the key's credits, refilling them first when a new period began.

        Returns the credits left, or None when too few were left (nothing is taken). Exact
        across processes: the store takes them in one atomic step. A key without credits
        (unlimited) is not for this method. A rolled key spends its successor's balance,
        which the pair shares (see `roll`).
        """
        return await self.store.spend_credits(
            record.id, cost, refill=refill_window(record.credit_refill)
        )
