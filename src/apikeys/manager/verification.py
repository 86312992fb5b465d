"""Verifying keys: `verify_now` from the key cache (no await), `verify` from the store, the
old strings of imported keys, and moving a key's hash to the current scheme."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, NamedTuple

from apikeys.bounded import remember
from apikeys.errors import (
    AuthenticationError,
    InvalidAPIKey,
    KeyDisabled,
    KeyExpired,
    KeyRevoked,
    MalformedAPIKey,
)
from apikeys.hashing import Verification
from apikeys.importing.foreign import (
    LOOKUP_SETTING,
    foreign_handles,
    is_foreign_token,
    lookup_ids,
)
from apikeys.keys import (
    CHECKSUM_LENGTH,
    ID_LENGTH,
    generate_key,
)
from apikeys.lifecycle import check_identity_usable, check_usable
from apikeys.manager.construction import ManagerBase, logger
from apikeys.types import (
    ACTIVE,
    KeyRecord,
    StoredKey,
    utcnow,
)

if TYPE_CHECKING:
    from apikeys.identities import IdentityRecord

__all__ = ["KeyVerification"]

# Where a record's masked prefix ("{key_prefix}_{id}_…") ends its key prefix.
_PREFIX_END = -ID_LENGTH - 3

# Versions of keys whose plain check `verify_now` keeps (see `KeyManager._plain_version`).
_PLAIN_LIMIT: Final = 10_000
_IMPORT_RECHECK = 1.0  # seconds between asking a store without imported keys again
# How `_decide` is asked (`now`): by `verify`, which may be told what to do first; by
# `verify_now`, which answers None where an await is needed, checking the key's identity
# held in process, or leaving it to its caller (`verify_now(identity=False)`).
_LATER: Final = 0
_NOW: Final = 1
_NOW_IDENTITY_LEFT: Final = 2
_LEGACY_DETAIL = (
    "Only keys imported from the old system are read under this Authorization scheme: "
    "send this key as 'Bearer <key>'."
)


class _SlowCheck(NamedTuple):
    """`_decide` cannot check the secret without blocking: check it against `secret_hash`
    off the event loop (`Hasher.averify`), and ask again with the verification."""

    secret_hash: str


class _Rehash(NamedTuple):
    """`_decide`'s answer for a usable key whose hash moves to another scheme or pepper:
    the hash is replaced (`new_hash`, or one made with `Hasher.ahash` when None), then the
    request is counted and `record` returned."""

    record: KeyRecord
    old_hash: str
    new_hash: str | None


class KeyVerification(ManagerBase):
    """The verification of a `KeyManager`: a token in, the record of a usable key out.

    One decision (`_decide`, which does no I/O) takes the token's parts and the stored key
    and answers: the record, a refusal raised, or what it needs first (a slow hash checked
    off the event loop, a hash moved). Two shells feed it: `verify_now` with the key held
    in process (the key cache, or the memory store), and `verify` with the key loaded from
    the store (`_load`), which does what the decision asks and asks again.
    """

    async def _decoy_hash(self) -> str:
        """A hash of a random secret, made as keys' hashes are: checked against when the
        key id is unknown."""
        decoy = self._decoy
        if decoy is None:
            decoy = self._decoy = await self.hasher.ahash(generate_key().secret)
        return decoy

    # -- the shells ------------------------------------------------------------------------

    async def verify(self, token: str, *, record_usage: bool = True) -> KeyRecord:
        """The record of the key `token` names, if it may be used now; else raise.

        Raises `MalformedAPIKey` (before any store access), `InvalidAPIKey`, `KeyDisabled`,
        `KeyRevoked`, `KeyExpired` or `StoreUnavailable`. Never returns an unusable key:
        a key of an identity that is disabled (revoked, or gone) is refused as a disabled
        (revoked) key, its detail saying it is the identity's doing.
        Counts the request in the key's usage unless `record_usage` is false. Asks
        `verify_now` first: a key held in process is decided without an await.
        """
        if not self.telemetry.active:
            record = self.verify_now(token, count=record_usage)
            if record is not None:
                return record
            return await self._verify(token, record_usage)
        started = time.perf_counter()
        try:
            record = await self._verify(token, record_usage)
        except AuthenticationError as exc:
            self.telemetry.verification(None, exc.code, time.perf_counter() - started)
            raise
        self.telemetry.verification(record.id, "ok", time.perf_counter() - started)
        return record

    async def verify_imported(self, token: str, *, record_usage: bool = True) -> KeyRecord:
        """`verify` for a key sent under a migration's legacy scheme (`Api-Key <key>`): only
        an imported key's old string is accepted. A key of this manager's format (or a
        damaged one) is refused with `MalformedAPIKey`, saying to send it as Bearer."""
        started = time.perf_counter()
        try:
            if not is_foreign_token(token, self.prefix):
                detail = _LEGACY_DETAIL if token.startswith(self.prefix + "_") else None
                raise MalformedAPIKey(detail)
            record = await self._verify_foreign(token, record_usage)
        except AuthenticationError as exc:
            if self.telemetry.active:
                self.telemetry.verification(None, exc.code, time.perf_counter() - started)
            raise
        if self.telemetry.active:
            self.telemetry.verification(record.id, "ok", time.perf_counter() - started)
        return record

    def verify_now(
        self, token: str, *, count: bool = True, identity: bool = True
    ) -> KeyRecord | None:
        """`verify` when it need not wait: from the key cache, or an in-process store.

        Returns the record of the key `token` names, its request counted, when the key is
        there and its hash is a fast one; raises what `verify` raises for such a key (and
        `MalformedAPIKey` for a malformed token that cannot be an imported key's). Returns
        None when the store must be read, the key is not found (an unknown id is checked
        against the decoy there), its hash moves to another scheme, its identity is not
        held (in the key cache, provably fresh, or an in-process store), or telemetry is on:
        then `await verify(token)` decides. The request path calls this first, to spare
        the awaits of a cached key.
        `count=False` leaves the request uncounted: the caller counts it with
        `usage_buffer.record(record.id)` once it has decided to go on without `verify`.
        `identity=False` leaves the key's identity to the caller, which must check it
        (`usable_identity_now`) before it goes on: the request path, which needs the
        identity's record anyway, so looks it up once.
        """
        if self.telemetry.active:
            return None
        unchecked: str | None
        prefix_end = self._prefix_end
        if (
            token.__class__ is str
            and (key_prefix := token[:prefix_end]) in self._environments
            and token[prefix_end] == "_"
            and token[self._id_end] == "_"
            and token.isascii()
        ):
            # Split by position, from the end. The token's alphabet and checksum are checked
            # by the full split (`_split`), unless its secret matches the held key's hash
            # and its checksum is the one of the token that matched before: then it is that
            # token.
            key_id = token[self._id_at : self._id_end]
            secret = token[self._secret_at : -CHECKSUM_LENGTH]
            unchecked = token
        else:
            try:
                key_prefix, key_id, secret = self._split(token)
            except MalformedAPIKey:
                if is_foreign_token(token, self.prefix):
                    return None  # perhaps an imported key's old string: `verify` looks it up
                raise
            unchecked = None
        if not self._in_use:
            self._use()
        # The key as this process holds it, without awaiting.
        cache = self.cache
        if cache is not None:
            stored = cache.hit(key_id)
        else:
            found = self.store.get_for_verification_now(key_id)
            stored = None if found is False else found
        if stored is None:
            if unchecked is not None:
                self._well_formed(unchecked)  # a malformed token is refused as such
            return None
        # With `now`, the decision is a record or None (left to `verify`).
        now = _NOW if identity else _NOW_IDENTITY_LEFT
        return self._decide(key_id, key_prefix, secret, stored, count, unchecked, now)  # type: ignore[return-value]

    async def _verify(self, token: str, record_usage: bool) -> KeyRecord:
        """`verify` from the store: the token split (its checksum checked), the key loaded,
        and decided."""
        if not self._pepper_checked:
            await self._check_pepper_once()
        try:
            key_prefix, key_id, secret = self._split(token)
        except MalformedAPIKey:
            return await self._verify_foreign(token, record_usage)
        if not self._in_use:
            self._use()
        if self._deliverer is not None:
            self._deliverer.start()  # (again, when the manager moved to another loop)
        stored = await self._load(key_id)
        return await self._settle(key_id, key_prefix, secret, stored, record_usage)

    async def _load(self, key_id: str) -> StoredKey | None:
        """The key to verify, from the key cache, or read from the store (a store that
        holds its keys in process answers `get_for_verification_now`)."""
        cache = self.cache
        if cache is None:
            found = self.store.get_for_verification_now(key_id)
            if found is False:
                return await self.store.get_for_verification(key_id)
            return found
        stored = cache.get(key_id)
        if self.telemetry.active:
            self.telemetry.cache_lookup(stored is not None)
        if stored is None and not cache.missing(key_id):
            stored = await cache.load(key_id)
        return stored

    async def _settle(
        self,
        key_id: str,
        key_prefix: str,
        secret: str,
        stored: StoredKey | None,
        count: bool,
        imported: bool = False,
    ) -> KeyRecord:
        """`_decide` with the awaits it asks for: the decoy hash made, a slow hash checked
        off the event loop, a hash moved to the current scheme."""
        at = key_id, key_prefix, secret
        # Counted here, once the key's identity (if any) lets it be used too.
        if stored is not None:
            decided = self._decide(*at, stored, False, None, _LATER, imported)
        else:
            decided = self._decide_unusual(*at, None, False, None, _LATER, imported)
        if decided is None:
            # An unknown id (or a key of another prefix) before the decoy hash was made.
            await self._decoy_hash()
            decided = self._decide_unusual(*at, None, False, None, _LATER, imported)
        if isinstance(decided, _SlowCheck):
            verified = await self.hasher.averify(secret, decided.secret_hash)
            decided = self._decide_unusual(*at, stored, False, None, _LATER, imported, verified)
        if isinstance(decided, _Rehash):
            record = decided.record
            if record.identity is not None:
                await self.usable_identity(record.identity)
            new_hash = decided.new_hash or await self.hasher.ahash(secret)
            await self._rehash(key_id, decided.old_hash, new_hash)
        elif decided is None or isinstance(decided, _SlowCheck):  # pragma: no cover
            raise AssertionError("a verification with the hash checked is decided")
        else:
            record = decided
            if record.identity is not None:
                await self.usable_identity(record.identity)
        if count:
            self.usage_buffer.record(key_id)
        return record

    # -- the decision ----------------------------------------------------------------------

    def _decide(
        self,
        key_id: str,
        key_prefix: str,
        secret: str,
        stored: StoredKey,
        count: bool,
        unchecked: str | None,
        now: int,
        imported: bool = False,
    ) -> KeyRecord | _SlowCheck | _Rehash | None:
        """Whether `secret` opens `stored`, the key of `key_id`, and the key may be used:
        its record (the request counted when `count`), or a refusal raised. No I/O.
        `key_prefix` is the token's (`ak_live`): the key's own, or the key is not found.

        `unchecked` is the whole token when it was split by position only: its format and
        checksum are checked before any answer but a match with a checksum seen before.
        `now` (`_NOW`, `_NOW_IDENTITY_LEFT`): for `verify_now`, which answers None where an
        await is needed. Otherwise (`_LATER`) the answer may be what must be done first
        (`_SlowCheck`, `_Rehash`).

        What this version of the key allows is worked out at its first request (see
        `_plain`): then a request costs its hash and its expiry, nothing else.
        """
        try:
            version, matches, checked, opened_by = self._plain[key_id]
        except KeyError:
            version = None
        if version is not stored:
            matches, checked = self._plain_version(key_id, stored), None
            opened_by = stored.record.key_prefix
        if matches is None or (key_prefix != opened_by and not imported):
            return self._decide_unusual(
                key_id, key_prefix, secret, stored, count, unchecked, now, imported
            )
        if not matches(secret):
            if unchecked is not None and not self._well_formed(unchecked):
                return None
            raise InvalidAPIKey()
        if unchecked is not None and unchecked[-CHECKSUM_LENGTH:] != checked:
            # The secret matched (so nothing here is a secret an answer's time could tell):
            # the first time for this version, the whole token's format and checksum.
            if not self._well_formed(unchecked):
                return None
            self._plain[key_id] = (stored, matches, unchecked[-CHECKSUM_LENGTH:], opened_by)
        # `check_usable` of a key known active (`_plain_version`): its expiry is left.
        record = stored.record
        if record.expires_at is not None and record.expires_at <= utcnow():
            raise KeyExpired()
        if record.identity is not None and now == _NOW:
            return self._identified_now(record, count)
        if count:
            self.usage_buffer.record(key_id)
        return record

    def _decide_unusual(
        self,
        key_id: str,
        key_prefix: str,
        secret: str,
        stored: StoredKey | None,
        count: bool,
        unchecked: str | None,
        now: int,
        imported: bool = False,
        verified: Verification | None = None,
    ) -> KeyRecord | _SlowCheck | _Rehash | None:
        """`_decide` of an unknown id (`stored` None), or of a key that is not active, not
        of the token's prefix, or whose hash is another scheme's or another pepper's.
        `verified`: the slow check `_SlowCheck` asked for."""
        if unchecked is not None and not self._well_formed(unchecked):
            return None
        # The prefix is part of the key: a test key re-prefixed as live is another key, so
        # the key is not found (the same answer as an unknown id, after the same work). The
        # environment is the record's: a key whose prefix names another is not ours either.
        # (An imported key's old string has no prefix of ours.)
        if stored is not None and not imported and not self._opens(stored.record, key_prefix):
            stored = None
        if stored is not None:
            secret_hash = stored.secret_hash
        elif self._decoy is not None:
            # Checked against a decoy: the same hash work as a wrong secret for a key that
            # exists, so that the time of a refusal does not tell whether an id exists. An
            # unknown old key string too: an imported key in use has a hash of this kind.
            secret_hash = self._decoy
        else:
            return None  # no decoy made yet: `_settle` makes it and asks again
        if verified is None:
            verified = self.hasher.verify_fast(secret, secret_hash)
            if verified is None:
                return None if now else _SlowCheck(secret_hash)
        if stored is None or not verified.ok:
            raise InvalidAPIKey()
        record = stored.record
        check_usable(record)
        if verified.new_hash is not None or verified.stale:
            return None if now else _Rehash(record, secret_hash, verified.new_hash)
        if record.identity is not None and now == _NOW:
            return self._identified_now(record, count)
        if count:
            self.usage_buffer.record(key_id)
        return record

    # -- the key's identity ----------------------------------------------------------------

    def _identified_now(self, record: KeyRecord, count: bool) -> KeyRecord | None:
        """`record` (a usable key of an identity) once its identity is found usable, held
        in process; None when it is not held (then `verify` reads it)."""
        if self.usable_identity_now(record.identity) is None:  # type: ignore[arg-type]
            return None
        if count:
            self.usage_buffer.record(record.id)
        return record

    def usable_identity_now(self, identity_id: str) -> IdentityRecord | None:
        """The identity `identity_id` of a key, held in process (the key cache while it is
        provably fresh, or an in-process store), if it lets its keys be used; raises
        `KeyDisabled` / `KeyRevoked` (`check_identity_usable`) if it does not or is known
        gone. None when it is not held: `await usable_identity(identity_id)` decides."""
        cache = self.cache
        if cache is not None:
            identity = cache.hit_identity(identity_id)
            if identity is None:
                if not cache.missing_identity(identity_id):
                    return None
                return check_identity_usable(None)
        else:
            identities = self._identity_store
            found = False if identities is None else identities.get_now(identity_id)
            if found is False:
                return None
            identity = found
        if identity is not None and identity.state == ACTIVE:
            return identity
        return check_identity_usable(identity)

    async def usable_identity(self, identity_id: str) -> IdentityRecord:
        """The identity `identity_id` of a key if it lets its keys be used, from the key
        cache or the store; else the refusal of `check_identity_usable`."""
        held = self.usable_identity_now(identity_id)
        if held is not None:
            return held
        cache = self.cache
        if cache is not None:
            if cache.missing_identity(identity_id):
                return check_identity_usable(None)
            return check_identity_usable(await cache.load_identity(identity_id))
        identities = self.store.identities()
        found = None if identities is None else await identities.get(identity_id)
        return check_identity_usable(found)

    def _opens(self, record: KeyRecord, key_prefix: str) -> bool:
        """Whether a token of `key_prefix` names `record`: the record's own prefix, one of
        this manager's, naming the record's environment."""
        # `prefix` is "{key_prefix}_{id}_…" and an id is ID_LENGTH long: the slice is
        # `KeyRecord.key_prefix`.
        return (
            record.prefix[:_PREFIX_END] == key_prefix
            and self._environments.get(key_prefix) == record.environment
        )

    def _well_formed(self, token: str) -> bool:
        """The full split's verdict on a token `verify_now` split by position: True when
        well formed; False when it is not but may be an imported key's old string (then
        `verify` looks it up); else `MalformedAPIKey`, as `verify_now` raises it."""
        try:
            self._split(token)
        except MalformedAPIKey:
            if is_foreign_token(token, self.prefix):
                return False
            raise
        return True

    def _plain_version(self, key_id: str, stored: StoredKey) -> Callable[[str], bool] | None:
        """The prepared check of `stored`'s hash, when nothing but the hash and the expiry is
        left to decide at each request: an active key of one of this manager's prefixes,
        naming its environment, whose hash is the hasher's current one (`_decide` then
        checks that a token has the key's prefix). None otherwise: `_decide_unusual`
        decides its every request. Remembered for the key's next requests, until the key
        (its `StoredKey`) changes."""
        record = stored.record
        matches = None
        key_prefix = record.key_prefix
        if record.state == ACTIVE and self._opens(record, key_prefix):
            matches = self.hasher.matcher(stored.secret_hash)
        remember(self._plain, key_id, (stored, matches, None, key_prefix), _PLAIN_LIMIT)
        return matches

    async def _verify_foreign(self, token: str, record_usage: bool) -> KeyRecord:
        """`verify` of a token not in this manager's key format: an imported key's old
        string, or else `MalformedAPIKey`.

        Keys of one old prefix (or digest) in several workspaces are all candidates: each
        is checked, the fast hashes (keys already re-hashed) first, so that the usual
        request of one workspace spends nothing on another's slow hash. A match whose key
        is usable wins; else the first refusal of a matching key (revoked, expired, …)."""
        imported = await self._find_imported(token)
        if imported is None:
            raise MalformedAPIKey()
        unknown_id, candidates = imported
        if not candidates:
            return await self._settle(unknown_id, "", token, None, record_usage, True)
        fast = self.hasher.is_fast
        ordered = sorted(candidates, key=lambda found: not fast(found[1].secret_hash))
        refusal: KeyRevoked | KeyDisabled | KeyExpired | None = None
        for key_id, stored in ordered:
            try:
                return await self._settle(key_id, "", token, stored, record_usage, True)
            except InvalidAPIKey:
                continue  # not this candidate's secret
            except (KeyRevoked, KeyDisabled, KeyExpired) as exc:  # its secret, not usable
                refusal = refusal or exc
        raise refusal or InvalidAPIKey()

    # -- imported keys (apikeys.importing) -------------------------------------------------

    async def _find_imported(
        self, token: str
    ) -> tuple[str, tuple[tuple[str, StoredKey], ...]] | None:
        """The keys an old system's key string may name (one per workspace holding a key of
        its old prefix or digest), with the id that stands for it when there are none, when
        this store holds imported keys and `token` could be one (None: it is simply
        malformed).

        Every id of every lookup handle the token could have is looked up, found or not,
        so the work done does not tell which old prefixes exist
        (`apikeys.importing.foreign`).
        """
        if not is_foreign_token(token, self.prefix):
            return None
        secret = await self._lookup_secret()
        if secret is None:
            return None
        if not self._in_use:
            self._use()
        unknown_id: str | None = None
        candidates: tuple[tuple[str, StoredKey], ...] = ()
        for handle in foreign_handles(token):
            for key_id in lookup_ids(secret, handle):
                stored = await self._load(key_id)
                if stored is not None:
                    candidates += ((key_id, stored),)
                elif unknown_id is None:
                    unknown_id = key_id
        return unknown_id or candidates[0][0], candidates

    async def _lookup_secret(self) -> str | None:
        """`import_lookup_secret(create=False)`, asked again at most once a second while
        the store has none, so that keys imported while the service runs work at once and
        garbage tokens cost the store almost nothing."""
        if self._import_secret is not None:
            return self._import_secret
        now = time.monotonic()
        if now - self._import_checked < _IMPORT_RECHECK:
            return None
        self._import_checked = now
        return await self.import_lookup_secret(create=False)

    async def import_lookup_secret(self, *, create: bool = True) -> str | None:
        """The store's secret for imported keys' ids (`apikeys.importing.foreign`), chosen
        now if it has none and `create` is true. None: the store holds no imported keys (or,
        with `create`, keeps no settings, so it cannot hold any)."""
        if create:
            recorded = await self.store.claim_setting(
                LOOKUP_SETTING, secrets.token_hex(32), replacing=("",)
            )
        else:
            # Claiming "" reads the setting without choosing a secret: importing replaces it.
            recorded = await self.store.claim_setting(LOOKUP_SETTING, "")
        if recorded:
            self._import_secret = recorded
        return recorded or None

    async def _rehash(self, key_id: str, old_hash: str, new_hash: str) -> None:
        try:
            # Announced, not waited for: either hash verifies the same secret.
            # The scheme's name only ("hmac-sha256", "argon2"): never the hash.
            parts = new_hash.split("$")
            scheme = parts[1] if new_hash.startswith("$") and len(parts) > 1 else parts[0]
            event = await self._event("rehashed", key_id, "apikeys", {"scheme": scheme})
            swapped = await self._change(
                key_id,
                lambda notice: self.store.replace_hash(
                    key_id, old_hash, new_hash, notice=notice, event=event
                ),
                wait=False,
            )
            if swapped:
                self._announce(event)
        except Exception as exc:
            # The request was verified; migration simply happens on a later one.
            logger.warning("apikeys: could not re-hash key %s: %s", key_id, type(exc).__name__)
