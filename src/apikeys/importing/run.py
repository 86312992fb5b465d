"""Importing keys: each old key becomes a record of apikeys that keeps its old hash."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from apikeys.errors import (
    ConfigurationError,
    DuplicateKeyId,
    IdentityNotFound,
    InvalidKeyParameters,
    InvalidTransition,
)
from apikeys.importing.foreign import (
    IMPORT_SLOTS,
    IMPORTED,
    cost_refusal,
    digest_handle,
    foreign_scheme,
    lookup_ids,
    needs_prefix,
    prefix_handle,
    valid_prefix,
)
from apikeys.importing.sources import ForeignKey, Refusal
from apikeys.keys import environment_prefix, mask
from apikeys.policies import check_text
from apikeys.scopes import validate_scopes
from apikeys.types import ACTIVE, LIVE, REVOKED, KeyRecord, StoredKey, utcnow

if TYPE_CHECKING:
    from apikeys.manager import KeyManager
    from apikeys.stores.contract import KeyStore

__all__ = ["ImportReport", "import_keys"]


@dataclass(slots=True)
class ImportReport:
    """What an import did (or, with `dry_run`, would do).

    `imported` holds the records made; `skipped` the ids of keys imported before (importing
    twice is harmless); `refused` each row not imported, with why; `revoked` the ids of keys
    imported before that their source now says are revoked, and that are revoked here too.
    """

    dry_run: bool
    imported: list[KeyRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    revoked: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON: counts, the imported records, skipped ids and refusals."""
        return {
            "dry_run": self.dry_run,
            "imported": len(self.imported),
            "skipped": len(self.skipped),
            "refused": len(self.refused),
            "revoked": len(self.revoked),
            "keys": [record.to_dict() for record in self.imported],
            "skipped_ids": list(self.skipped),
            "refusals": [refusal.to_dict() for refusal in self.refused],
            "revoked_ids": list(self.revoked),
        }


def _handle(key: ForeignKey) -> str:
    """How the key will be found: by its old prefix, or by the digest its hash is. Raises
    `ValueError` with the reason it cannot be found."""
    hashed = key.hashed
    if key.prefix is not None:
        if not valid_prefix(key.prefix):
            raise ValueError("the prefix is 1 to 64 printable characters without '.' or spaces")
        return prefix_handle(key.prefix)
    if hashed.startswith("sha512$$"):  # SHA-512 of the whole key, without a salt
        return digest_handle("sha512", hashed[len("sha512$$") :])
    if needs_prefix(hashed):
        raise ValueError(
            "a salted hash cannot find its key: give the key's prefix (the part before its "
            "'.') in a prefix column"
        )
    algorithm, _, hex_digest = hashed.partition(":")
    return digest_handle(algorithm, hex_digest)


async def _slot(
    store: KeyStore, secret: str | None, handle: str, workspace: str
) -> tuple[str, StoredKey | None]:
    """The id of `workspace`'s imported key of this handle, and that key when it was
    imported before (else the first free id of the handle). Raises `ValueError` when every
    id of the handle holds another workspace's key."""
    if secret is None:  # a dry run of a store that holds no imports yet
        return lookup_ids("", handle)[0], None
    free = None
    for key_id in lookup_ids(secret, handle):
        stored = await store.get(key_id)
        if stored is not None and stored.record.workspace == workspace:
            return key_id, stored
        if stored is None and free is None:
            free = key_id
    if free is None:
        raise ValueError(
            f"a key of the same old prefix (or the same hash) is already imported in "
            f"{IMPORT_SLOTS} other workspaces, the most apikeys finds at each request"
        )
    return free, None


def _checked(key: ForeignKey, own_prefix: str) -> tuple[str, str, str]:
    """The row's name, its hash's scheme and its lookup handle. Raises `ValueError` with
    the reason the row cannot be imported."""
    name = _name(key.name)
    if key.workspace is not None:
        _workspace(key.workspace)
    scheme = foreign_scheme(key.hashed)
    if scheme is None:
        raise ValueError("the hash is in no format apikeys can check (see docs/migrating.md)")
    too_costly = cost_refusal(key.hashed)
    if too_costly is not None:
        raise ValueError(too_costly)
    handle = _handle(key)
    if key.prefix is not None and key.prefix.startswith(f"{own_prefix}_"):
        # `ak_live.…` reads as a key of this service's own format: never found.
        raise ValueError(
            f"its old prefix starts with this service's own key prefix "
            f"'{own_prefix}_', so the old key would read as an apikeys key and "
            "never be found: import it into a service with another key prefix"
        )
    return name, scheme, handle


def _name(name: str) -> str:
    if not name.strip():
        raise ValueError("the name is empty")
    try:
        return check_text(name, "the name")
    except InvalidKeyParameters as exc:
        raise ValueError(str(exc)) from None


def _workspace(workspace: str) -> str:
    try:
        return check_text(workspace, "the workspace")
    except InvalidKeyParameters as exc:
        raise ValueError(f"{exc} (from the workspace column)") from None


@dataclass(frozen=True, slots=True)
class _Import:
    """What every row of one import shares."""

    manager: KeyManager
    secret: str | None
    source: str
    workspace: str
    scopes: tuple[str, ...]
    full_access: bool
    dry_run: bool
    actor: str | None
    now: datetime
    # (identity id, workspace) -> why a key of that workspace cannot belong to it, or None
    checked: dict[tuple[str, str], str | None] = field(default_factory=dict)

    async def check_identity(self, identity_id: str, workspace: str) -> None:
        """`ValueError` saying why a key of `workspace` cannot belong to the identity
        `identity_id` (not an id, none of that workspace, revoked); read once per import."""
        wanted = (identity_id, workspace)
        if wanted not in self.checked:
            try:
                await self.manager.check_identity(identity_id, workspace)
                self.checked[wanted] = None
            except (InvalidKeyParameters, IdentityNotFound, InvalidTransition) as exc:
                self.checked[wanted] = f"{exc} (from the identity column)"
            except ConfigurationError as exc:
                self.checked[wanted] = str(exc)
        why = self.checked[wanted]
        if why is not None:
            raise ValueError(why)


async def import_keys(
    manager: KeyManager,
    keys: Iterable[ForeignKey | Refusal],
    *,
    source: str,
    workspace: str = "default",
    scopes: Sequence[str] = (),
    full_access: bool = False,
    dry_run: bool = False,
    actor: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> ImportReport:
    """Import other systems' keys into `manager`'s store, keeping their hashes.

    Each old key string then works as it is (`KeyManager.verify`), and is re-hashed with
    apikeys' own scheme on its first successful use. Imported keys keep their names,
    creation times, expiry and revoked status, in `workspace` (or the one a row names,
    `ForeignKey.workspace`: a row naming no valid workspace is refused), in the identity a
    row names (`ForeignKey.identity`: an identity of the key's workspace that is not
    revoked, else the row is refused; identities are never made by an import), with
    `full_access` or
    `scopes` (a bad `workspace` or scope raises `InvalidKeyParameters`, before any row
    is read). A key imported before is skipped, unless its source now says it is revoked
    and it is not: then it is revoked (a key revoked in the old system after a first import
    never stays usable here). Both are per workspace: the same old prefix imported into
    another workspace is another key (`apikeys.importing.foreign.IMPORT_SLOTS` workspaces at
    most). A hash that costs more than its scheme's bound (`foreign.COST_BOUNDS`) is
    refused; `dry_run` changes nothing and reports what would happen.
    `source` names the old system in the audit trail (`drf-api-key`, `csv`); `progress(1)`
    is called after each row. Keys are added and revoked through the manager
    (`KeyManager.add_imported`, `KeyManager.revoke`).
    """
    check_text(workspace, "workspace")
    scope_tuple = validate_scopes(scopes)
    if full_access == bool(scope_tuple):
        raise ConfigurationError("imported keys take full access or at least one scope")
    # A dry run chooses no secret: without one, nothing was imported before.
    secret = await manager.import_lookup_secret(create=not dry_run)
    if secret is None and not dry_run:
        raise ConfigurationError("this key store keeps no settings: it cannot hold imports")
    run = _Import(
        manager, secret, source, workspace, scope_tuple, full_access, dry_run, actor, utcnow()
    )
    report = ImportReport(dry_run=dry_run)
    seen: set[tuple[str, str]] = set()
    for key in keys:
        if progress is not None:
            progress(1)
        if isinstance(key, Refusal):
            report.refused.append(key)
        else:
            await _import_row(run, key, seen, report)
    return report


async def _import_row(
    run: _Import, key: ForeignKey, seen: set[tuple[str, str]], report: ImportReport
) -> None:
    """Import one row (or refuse it, skip it, or revoke the key it imported before)."""
    manager = run.manager
    try:
        name, scheme, handle = _checked(key, manager.prefix)
    except ValueError as exc:
        report.refused.append(Refusal(key.row, key.name or None, str(exc)))
        return
    workspace = run.workspace if key.workspace is None else key.workspace
    try:
        if (workspace, handle) in seen:
            raise ValueError("an earlier row has the same prefix or the same hash")
        seen.add((workspace, handle))
        key_id, before = await _slot(manager.store, run.secret, handle, workspace)
    except ValueError as exc:
        report.refused.append(Refusal(key.row, name, str(exc)))
        return
    if before is not None:
        if key.revoked and before.record.state != REVOKED:
            if not run.dry_run:
                await manager.revoke(key_id, actor=run.actor)
            report.revoked.append(key_id)
        else:
            report.skipped.append(key_id)
        return
    if key.identity is not None:
        try:
            await run.check_identity(key.identity, workspace)
        except ValueError as exc:
            report.refused.append(Refusal(key.row, name, str(exc)))
            return
    now = run.now
    record = _record(run, key, key_id, name, workspace)
    if not run.dry_run:
        try:
            await manager.add_imported(
                record,
                IMPORTED + key.hashed,
                source=run.source,
                scheme=scheme,
                actor=run.actor,
                at=now,
            )
        except DuplicateKeyId:  # imported by a concurrent run
            holder = await manager.store.get(key_id)
            if holder is not None and holder.record.workspace != workspace:
                reason = "another workspace's import took its id meanwhile: import it again"
                report.refused.append(Refusal(key.row, name, reason))
            else:
                report.skipped.append(key_id)
            return
    report.imported.append(record)


def _record(run: _Import, key: ForeignKey, key_id: str, name: str, workspace: str) -> KeyRecord:
    """The record an imported row becomes."""
    manager, now = run.manager, run.now
    return KeyRecord(
        id=key_id,
        name=name,
        workspace=workspace,
        # Shown as a key of this manager's: the bare prefix for a live key (as keys made
        # before environments), `ak_test_` for a test key, so its environment reads alike.
        prefix=mask(
            manager.prefix
            if key.environment == LIVE
            else environment_prefix(manager.prefix, key.environment),
            key_id,
        ),
        access="full" if run.full_access else "restricted",
        scopes=run.scopes,
        state=REVOKED if key.revoked else ACTIVE,
        rate_limit=None,
        created_at=key.created_at or now,
        expires_at=key.expires_at,
        revoked_at=now if key.revoked else None,
        imported_prefix=key.prefix,
        environment=key.environment,
        identity=key.identity,
    )
