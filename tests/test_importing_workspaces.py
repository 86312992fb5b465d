"""Imported keys are keyed by (workspace, old prefix), and an old system's hash costs no
more than a bound per scheme: at import (refused, with why) and at verification (a failed
match, without hashing). Run on every store of the table in tests/conftest.py."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from passlib.hash import argon2, bcrypt, django_pbkdf2_sha256, pbkdf2_sha256

from apikeys import KeyManager
from apikeys.errors import InvalidAPIKey, KeyRevoked
from apikeys.hashing import Hasher
from apikeys.importing import ForeignKey, foreign, import_keys
from apikeys.importing.foreign import IMPORTED, lookup_id, prefix_handle
from apikeys.keys import mask
from apikeys.stores.contract import KeyStore
from apikeys.types import ACTIVE, KeyRecord, StoredKey, utcnow
from tests.conftest import TEST_PEPPER

OLD_PREFIX = "KHNhgcGJ"


@pytest.fixture
async def importer(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(TEST_PEPPER)) as manager:
        yield manager


def _drf_hash(key: str) -> str:
    return "sha512$$" + hashlib.sha512(key.encode()).hexdigest()


def _pbkdf2(key: str) -> str:
    return str(django_pbkdf2_sha256.using(rounds=1000).hash(key))


async def _import(
    manager: KeyManager, workspace: str, hashed: str, *, revoked: bool = False
) -> Any:
    key = ForeignKey(1, f"{workspace} key", hashed, prefix=OLD_PREFIX, revoked=revoked)
    return await import_keys(manager, [key], source="csv", workspace=workspace, full_access=True)


# -- (workspace, old prefix) --------------------------------------------------------------


async def test_if_same_old_prefix_imported_into_two_workspaces_then_both_keys_work(
    importer: KeyManager,
) -> None:
    acme_key, globex_key = f"{OLD_PREFIX}.acme-secret-0001", f"{OLD_PREFIX}.globex-secret-02"
    first = await _import(importer, "acme", _pbkdf2(acme_key))
    second = await _import(importer, "globex", _pbkdf2(globex_key))
    assert len(first.imported) == len(second.imported) == 1
    assert second.skipped == []
    assert (await importer.verify(acme_key)).workspace == "acme"
    assert (await importer.verify(globex_key)).workspace == "globex"
    # Again, now that both are re-hashed with apikeys' own scheme.
    assert (await importer.verify(globex_key)).workspace == "globex"
    assert (await importer.verify(acme_key)).workspace == "acme"
    with pytest.raises(InvalidAPIKey):
        await importer.verify(f"{OLD_PREFIX}.neither-of-them")
    # Imported a second time: each is skipped in its own workspace, nothing more is made.
    again = await _import(importer, "globex", _pbkdf2(globex_key))
    assert again.imported == []
    assert again.skipped == [second.imported[0].id]


async def test_if_the_same_old_key_is_in_two_workspaces_then_revoking_one_leaves_the_other(
    importer: KeyManager,
) -> None:
    old_key = f"{OLD_PREFIX}.shared-by-two-tenants"
    acme = (await _import(importer, "acme", _drf_hash(old_key))).imported[0]
    globex = (await _import(importer, "globex", _drf_hash(old_key))).imported[0]
    assert acme.id != globex.id
    report = await _import(importer, "acme", _drf_hash(old_key), revoked=True)
    assert report.revoked == [acme.id]
    assert (await importer.store.get(globex.id)).record.state == ACTIVE  # type: ignore[union-attr]
    # The old key string still opens the workspace where it is not revoked.
    assert (await importer.verify(old_key)).id == globex.id


async def test_if_reimported_as_revoked_then_only_that_workspaces_key_is_revoked(
    importer: KeyManager,
) -> None:
    acme_key, globex_key = f"{OLD_PREFIX}.acme-secret-0001", f"{OLD_PREFIX}.globex-secret-02"
    await _import(importer, "acme", _pbkdf2(acme_key))
    await _import(importer, "globex", _pbkdf2(globex_key))
    report = await _import(importer, "globex", _pbkdf2(globex_key), revoked=True)
    assert len(report.revoked) == 1
    with pytest.raises(KeyRevoked):
        await importer.verify(globex_key)
    assert (await importer.verify(acme_key)).workspace == "acme"


async def test_if_an_old_prefix_is_in_too_many_workspaces_then_the_next_is_refused(
    importer: KeyManager,
) -> None:
    for number in range(foreign.IMPORT_SLOTS):
        report = await _import(importer, f"w{number}", _drf_hash(f"{OLD_PREFIX}.k{number:08}"))
        assert len(report.imported) == 1
    report = await _import(importer, "one-too-many", _drf_hash(f"{OLD_PREFIX}.k99999999"))
    assert report.imported == []
    assert "workspaces" in report.refused[0].reason
    for number in range(foreign.IMPORT_SLOTS):
        assert (await importer.verify(f"{OLD_PREFIX}.k{number:08}")).workspace == f"w{number}"


# -- hash costs ---------------------------------------------------------------------------

OVER_COST = {
    "pbkdf2 rounds": django_pbkdf2_sha256.using(rounds=1000)
    .hash("x")
    .replace("$1000$", f"${2**31 - 1}$"),
    "pbkdf2 rounds past 2**32": django_pbkdf2_sha256.using(rounds=1000)
    .hash("x")
    .replace("$1000$", f"${2**32 - 1}$"),
    "passlib pbkdf2 rounds": pbkdf2_sha256.using(rounds=1000)
    .hash("x")
    .replace("$1000$", f"${2**31 - 1}$"),
    "bcrypt cost": bcrypt.using(rounds=4).hash("x").replace("$04$", "$31$"),
    "argon2 memory": argon2.using(memory_cost=8, rounds=1, parallelism=1)
    .hash("x")
    .replace("m=8,", "m=4194304,"),
    "argon2 time": argon2.using(memory_cost=8, rounds=1, parallelism=1)
    .hash("x")
    .replace("t=1,", "t=1000,"),
}


@pytest.mark.parametrize("hashed", OVER_COST.values(), ids=OVER_COST.keys())
async def test_if_an_imported_hash_costs_more_than_its_bound_then_import_refuses_it(
    importer: KeyManager, hashed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = await _import(importer, "acme", hashed)
    assert report.imported == []
    assert "cost" in report.refused[0].reason
    assert hashed not in report.refused[0].reason


async def _stored_as_imported(manager: KeyManager, hashed: str) -> None:
    """A record holding `hashed` as its imported hash: a row imported before the bounds, or
    edited by hand."""
    secret = await manager.import_lookup_secret()
    assert secret is not None
    key_id = lookup_id(secret, prefix_handle(OLD_PREFIX))
    record = KeyRecord(
        id=key_id,
        name="old",
        workspace="acme",
        prefix=mask(manager.prefix, key_id),
        access="full",
        scopes=(),
        state=ACTIVE,
        rate_limit=None,
        created_at=utcnow(),
    )
    await manager.store.insert(StoredKey(record, IMPORTED + hashed))


@pytest.mark.parametrize("hashed", OVER_COST.values(), ids=OVER_COST.keys())
async def test_if_a_stored_imported_hash_costs_more_than_its_bound_then_verify_fails_unhashed(
    importer: KeyManager, hashed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from passlib.context import CryptContext

    await _stored_as_imported(importer, hashed)
    hashed_with: list[str] = []
    real_verify = CryptContext.verify

    def counting(self: Any, secret: Any, stored: Any, *args: Any, **kwargs: Any) -> Any:
        hashed_with.append(stored)
        return real_verify(self, secret, stored, *args, **kwargs)

    monkeypatch.setattr(CryptContext, "verify", counting)
    with pytest.raises(InvalidAPIKey):
        await importer.verify(f"{OLD_PREFIX}.any-secret-at-all")
    assert hashed_with == []  # refused on the hash's parameters: no key stretching spent


@pytest.mark.parametrize(
    "error", [OverflowError("iteration value is too great"), ValueError("bad"), TypeError("x")]
)
async def test_if_checking_an_imported_hash_raises_then_it_is_a_failed_match_not_an_error(
    importer: KeyManager, error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    from passlib.context import CryptContext

    await _stored_as_imported(importer, _pbkdf2(f"{OLD_PREFIX}.the-old-key"))

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(CryptContext, "verify", failing)
    with pytest.raises(InvalidAPIKey):
        await importer.verify(f"{OLD_PREFIX}.the-old-key")


async def test_a_stored_hash_of_2_to_the_32_rounds_is_401_not_503(importer: KeyManager) -> None:
    await _stored_as_imported(importer, OVER_COST["pbkdf2 rounds past 2**32"])
    with pytest.raises(InvalidAPIKey):
        await importer.verify(f"{OLD_PREFIX}.any-secret-at-all")


def test_hashes_at_their_schemes_defaults_are_within_the_bounds() -> None:
    cheap_pbkdf2 = django_pbkdf2_sha256.using(rounds=1000).hash("x")
    cheap_argon2 = argon2.using(memory_cost=8, rounds=1, parallelism=1).hash("x")
    for hashed in (  # written, not made: making them would spend what the bounds save
        cheap_pbkdf2.replace("$1000$", "$1200000$"),  # Django 6.0's default
        bcrypt.using(rounds=4).hash("x").replace("$04$", "$12$"),
        cheap_argon2.replace("m=8,t=1,p=1", "m=102400,t=2,p=8"),  # Django's default
        cheap_argon2.replace("m=8,t=1,p=1", "m=65536,t=3,p=4"),  # argon2-cffi's default
    ):
        assert foreign.cost_refusal(hashed) is None


def test_docs_state_the_bounds_and_the_workspaces_the_code_has() -> None:
    from pathlib import Path

    text = " ".join((Path(__file__).parent.parent / "docs" / "migrating.md").read_text().split())
    bounds = foreign.COST_BOUNDS
    assert f"PBKDF2 {bounds['django_pbkdf2_sha256']['rounds']:,} rounds" in text
    assert f"bcrypt cost {bounds['bcrypt']['rounds']}" in text
    argon2_bounds = bounds["argon2"]
    assert (
        f"argon2 memory {argon2_bounds['memory_cost']:,} KiB, time {argon2_bounds['rounds']} "
        f"and parallelism {argon2_bounds['parallelism']}"
    ) in text
    assert f"SHA-crypt {bounds['sha512_crypt']['rounds']:,} rounds" in text
    assert f"A handle has {foreign.IMPORT_SLOTS} ids" in text
