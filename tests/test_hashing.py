"""How secrets are hashed at rest and checked (CONTRACT §1): peppers, schemes, migration."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from passlib.context import CryptContext

from apikeys import KeyManager, MemoryStore
from apikeys.errors import ConfigurationError, InvalidAPIKey, KeyRevoked
from apikeys.hashing import PEPPER_ENV, Hasher, Verification, slow_context
from apikeys.keys import ParsedKey, parse_key

PEPPER = "JJuig-tWXOR8VxCZNxV4kUEhhjZIIrFPdCK-1xxIyR4"
OLD_PEPPER = "Aormn18nQbH_8Y3yLe7fwgZGENucmtncEpwDXjhMY7k"
SECRET = "Vd2hR8sLk4NwQ1e9TfYb6GcJ0uMiPzXa"
OTHER_SECRET = "Vd2hR8sLk4NwQ1e9TfYb6GcJ0uMiPzXb"

HMAC_RE = re.compile(r"^hmac-sha256\$([0-9a-f]{64})$")
SHA256_RE = re.compile(r"^sha256\$([0-9a-f]{64})$")


@pytest.fixture(autouse=True)
def _no_pepper_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test says which pepper it uses; none inherits one from the environment."""
    monkeypatch.delenv(PEPPER_ENV, raising=False)


def _hmac_hex(pepper: str | bytes, secret: str) -> str:
    key = pepper.encode() if isinstance(pepper, str) else pepper
    return hmac.new(key, secret.encode(), hashlib.sha256).hexdigest()


def _fast_context(*schemes: str, **settings: object) -> CryptContext:
    """A passlib context with low costs, so the slow schemes stay quick in tests."""
    return CryptContext(
        schemes=list(schemes),
        deprecated="auto",
        pbkdf2_sha256__rounds=1000,
        argon2__memory_cost=1024,
        argon2__time_cost=1,
        argon2__parallelism=1,
        bcrypt__rounds=4,
        **settings,
    )


class RecordingHasher(Hasher):
    """A Hasher that records the thread of each `verify` call and counts them."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.threads: list[threading.Thread] = []

    def verify(self, secret: str, stored: str) -> Verification:
        self.threads.append(threading.current_thread())
        return super().verify(secret, stored)


# -- the default scheme: HMAC-SHA256 with a pepper ------------------------------------------


@pytest.mark.parametrize(
    "pepper",
    [
        pytest.param(PEPPER, id="str"),
        pytest.param(PEPPER.encode(), id="bytes"),
        pytest.param("zs9ec7MA979B3TxnmXPtiwY-YBSm132Y", id="minimum-length"),
        pytest.param(
            "f6f16e7c2095075caf82ad62678880a7a3934b0c7618771eebae648b8d8e89db", id="block-size"
        ),
        pytest.param(
            "QNe-nr_fDEZK0CTGzgl4a987LfIJDqt34LBc6gGKYmWC2zuPzhvMxRYbis0rJe8OA",
            id="longer-than-block",
        ),
        pytest.param(bytes(range(56, 256)), id="long-binary"),
    ],
)
def test_if_pepper_set_then_hash_is_hmac_sha256_of_the_secret(pepper: str | bytes) -> None:
    stored = Hasher(pepper).hash(SECRET)
    match = HMAC_RE.fullmatch(stored)
    assert match, stored
    assert match.group(1) == _hmac_hex(pepper, SECRET)


def test_if_pepper_set_then_verify_accepts_the_secret_and_needs_no_update() -> None:
    hasher = Hasher(PEPPER)
    assert hasher.verify(SECRET, hasher.hash(SECRET)) == Verification(True, None)


def test_if_secret_wrong_then_not_ok() -> None:
    hasher = Hasher(PEPPER)
    stored = hasher.hash(SECRET)
    assert hasher.verify(OTHER_SECRET, stored) == Verification(False, None)
    assert hasher.verify("", stored).ok is False
    assert hasher.verify(SECRET.upper(), stored).ok is False


def test_if_same_pepper_then_hashers_agree() -> None:
    first, second = Hasher(PEPPER), Hasher(PEPPER)
    assert first.hash(SECRET) == second.hash(SECRET)
    assert second.verify(SECRET, first.hash(SECRET)).ok


def test_if_pepper_id_shown_then_it_is_not_the_pepper() -> None:
    stored = Hasher(PEPPER).hash(SECRET)
    assert PEPPER not in stored
    assert PEPPER.encode().hex()[:8] not in stored


@pytest.mark.parametrize("pepper", ["", "short", "x" * 15, b"x" * 15])
def test_if_pepper_shorter_than_16_bytes_then_configuration_error(pepper: str | bytes) -> None:
    with pytest.raises(ConfigurationError):
        Hasher(pepper)


def test_if_old_pepper_shorter_than_16_bytes_then_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        Hasher(PEPPER, old_peppers=["short"])


def test_if_pepper_short_then_error_does_not_echo_it() -> None:
    with pytest.raises(ConfigurationError) as caught:
        Hasher("tiny-pepper-1")
    assert "tiny-pepper-1" not in str(caught.value)


def test_if_pepper_env_set_then_hasher_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEPPER_ENV, PEPPER)
    stored = Hasher().hash(SECRET)
    match = HMAC_RE.fullmatch(stored)
    assert match, stored
    assert match.group(1) == _hmac_hex(PEPPER, SECRET)
    assert Hasher(PEPPER).verify(SECRET, stored) == Verification(True, None)


def test_if_pepper_env_too_short_then_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PEPPER_ENV, "short")
    with pytest.raises(ConfigurationError):
        Hasher()


def test_if_pepper_passed_then_it_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEPPER_ENV, OLD_PEPPER)
    match = HMAC_RE.fullmatch(Hasher(PEPPER).hash(SECRET))
    assert match
    assert match.group(1) == _hmac_hex(PEPPER, SECRET)


# -- no pepper: plain SHA-256 with a warning -------------------------------------------------


def test_if_no_pepper_then_hash_is_sha256_and_a_warning_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="apikeys"):
        hasher = Hasher()
    stored = hasher.hash(SECRET)
    assert SHA256_RE.fullmatch(stored), stored
    assert stored == "sha256$" + hashlib.sha256(SECRET.encode()).hexdigest()
    warnings = [
        record
        for record in caplog.records
        if record.name == "apikeys" and record.levelno == logging.WARNING
    ]
    assert warnings, caplog.text
    assert PEPPER_ENV in warnings[0].getMessage()


def test_if_pepper_env_empty_then_treated_as_unset(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(PEPPER_ENV, "")
    with caplog.at_level(logging.WARNING, logger="apikeys"):
        stored = Hasher().hash(SECRET)
    assert stored.startswith("sha256$")
    assert any(record.name == "apikeys" for record in caplog.records)


def test_if_pepper_set_then_no_warning_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="apikeys"):
        Hasher(PEPPER)
    assert not [record for record in caplog.records if record.name == "apikeys"]


def test_if_no_pepper_then_verify_accepts_the_secret_and_refuses_others() -> None:
    hasher = Hasher()
    stored = hasher.hash(SECRET)
    assert hasher.verify(SECRET, stored) == Verification(True, None)
    assert hasher.verify(OTHER_SECRET, stored) == Verification(False, None)


# -- migration between fast schemes ----------------------------------------------------------


def test_if_hash_made_with_old_pepper_then_verifies_and_migrates_to_current() -> None:
    old_hash = Hasher(OLD_PEPPER).hash(SECRET)
    hasher = Hasher(PEPPER, old_peppers=[OLD_PEPPER])
    verdict = hasher.verify(SECRET, old_hash)
    assert verdict.ok
    assert verdict.new_hash is not None
    assert verdict.new_hash == Hasher(PEPPER).hash(SECRET)
    # The migrated hash is current: verifying it asks for no further update.
    assert hasher.verify(SECRET, verdict.new_hash) == Verification(True, None)


def test_if_hash_made_with_old_pepper_then_wrong_secret_is_refused() -> None:
    old_hash = Hasher(OLD_PEPPER).hash(SECRET)
    hasher = Hasher(PEPPER, old_peppers=[OLD_PEPPER])
    assert hasher.verify(OTHER_SECRET, old_hash) == Verification(False, None)


def test_if_old_pepper_not_passed_then_its_hashes_fail() -> None:
    old_hash = Hasher(OLD_PEPPER).hash(SECRET)
    assert Hasher(PEPPER).verify(SECRET, old_hash) == Verification(False, None)


def test_if_pepper_id_unknown_then_verify_fails() -> None:
    # The right digest under an id that names no configured pepper is still refused.
    stored = f"hmac-sha256$deadbeef${_hmac_hex(PEPPER, SECRET)}"
    assert Hasher(PEPPER).verify(SECRET, stored) == Verification(False, None)


def test_if_sha256_hash_and_pepper_set_and_upgrade_allowed_then_verifies_and_migrates() -> None:
    plain = Hasher().hash(SECRET)
    assert plain.startswith("sha256$")
    verdict = Hasher(PEPPER, allow_unpeppered=True).verify(SECRET, plain)
    assert verdict.ok
    assert verdict.new_hash is not None
    assert HMAC_RE.fullmatch(verdict.new_hash)
    assert verdict.new_hash == Hasher(PEPPER).hash(SECRET)


def test_if_sha256_hash_and_wrong_secret_then_no_migration() -> None:
    plain = Hasher().hash(SECRET)
    assert Hasher(PEPPER).verify(OTHER_SECRET, plain) == Verification(False, None)


@pytest.mark.parametrize(
    "stored",
    ["", "garbage", "hmac-sha256$", "hmac-sha256$$", "sha256$", "sha256$zz", "md5$abc"],
)
def test_if_stored_hash_is_unrecognised_then_not_ok(stored: str) -> None:
    assert Hasher(PEPPER).verify(SECRET, stored) == Verification(False, None)


# -- slow schemes through passlib -------------------------------------------------------------


def test_if_pbkdf2_context_then_new_hashes_are_pbkdf2_and_verify() -> None:
    hasher = Hasher(context=slow_context("pbkdf2_sha256"))
    stored = hasher.hash(SECRET)
    assert stored.startswith("$pbkdf2-sha256$")
    assert hasher.verify(SECRET, stored) == Verification(True, None)
    assert hasher.verify(OTHER_SECRET, stored).ok is False


def test_if_slow_context_then_no_pepper_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="apikeys"):
        Hasher(context=slow_context("pbkdf2_sha256"))
    assert not [record for record in caplog.records if record.name == "apikeys"]


def test_if_scheme_deprecated_then_verify_rehashes_to_the_preferred_one() -> None:
    pbkdf2_hash = Hasher(context=slow_context("pbkdf2_sha256")).hash(SECRET)
    context = CryptContext(schemes=["argon2", "pbkdf2_sha256"], deprecated="auto")
    hasher = Hasher(context=context)
    verdict = hasher.verify(SECRET, pbkdf2_hash)
    assert verdict.ok
    assert verdict.new_hash is not None
    assert verdict.new_hash.startswith("$argon2")
    assert hasher.verify(SECRET, verdict.new_hash) == Verification(True, None)


def test_if_scheme_deprecated_and_secret_wrong_then_no_rehash() -> None:
    pbkdf2_hash = Hasher(context=_fast_context("pbkdf2_sha256")).hash(SECRET)
    hasher = Hasher(context=_fast_context("argon2", "pbkdf2_sha256"))
    assert hasher.verify(OTHER_SECRET, pbkdf2_hash) == Verification(False, None)


async def test_if_fast_hash_and_slow_context_then_migrates_to_the_slow_scheme() -> None:
    fast = Hasher(PEPPER).hash(SECRET)
    hasher = Hasher(PEPPER, context=_fast_context("pbkdf2_sha256"))
    verdict = hasher.verify(SECRET, fast)
    # verify() never runs the slow scheme itself: it flags the hash, ahash() makes the new one.
    assert verdict == Verification(True, None, stale=True)
    new_hash = await hasher.ahash(SECRET)
    assert new_hash.startswith("$pbkdf2-sha256$")
    assert hasher.verify(SECRET, new_hash).ok


async def test_if_slow_scheme_then_create_and_migration_hash_off_the_event_loop() -> None:
    threads: list[threading.Thread] = []

    class Recording(Hasher):
        def hash(self, secret: str) -> str:
            threads.append(threading.current_thread())
            return super().hash(secret)

    store = MemoryStore()
    async with KeyManager(store, hasher=Hasher(PEPPER)) as fast:
        created = await fast.create(name="n", workspace="w", full_access=True)
    slow_hasher = Recording(PEPPER, context=_fast_context("pbkdf2_sha256"))
    async with KeyManager(store, hasher=slow_hasher) as slow:
        await slow.create(name="m", workspace="w", full_access=True)
        await slow.verify(created.key)
    stored = await store.get(created.record.id)
    assert stored is not None
    assert stored.secret_hash.startswith("$pbkdf2-sha256$")
    assert len(threads) == 2
    assert all(thread is not threading.main_thread() for thread in threads)


@pytest.mark.parametrize("scheme", ["pbkdf2_sha256", "bcrypt", "argon2"])
def test_if_slow_hash_and_no_context_then_verifies_and_moves_to_fast_scheme(
    scheme: str,
) -> None:
    slow = Hasher(context=_fast_context(scheme)).hash(SECRET)
    hasher = Hasher(PEPPER)
    verdict = hasher.verify(SECRET, slow)
    assert verdict.ok
    assert verdict.new_hash == hasher.hash(SECRET)
    assert hasher.verify(OTHER_SECRET, slow) == Verification(False, None)


def test_if_slow_context_then_scheme_names_it() -> None:
    assert Hasher(context=slow_context("pbkdf2_sha256")).scheme == "pbkdf2_sha256"
    assert Hasher(PEPPER).scheme == "hmac-sha256"
    assert Hasher().scheme == "sha256"


# -- averify: off the event loop, with a cache ------------------------------------------------


async def test_if_slow_hash_then_averify_runs_verify_off_the_event_loop_thread() -> None:
    loop_thread = threading.current_thread()
    hasher = RecordingHasher(context=_fast_context("bcrypt"))
    stored = hasher.hash(SECRET)
    verdict = await hasher.averify(SECRET, stored)
    assert verdict == Verification(True, None)
    assert len(hasher.threads) == 1
    assert hasher.threads[0] is not loop_thread


async def test_if_argon2_hash_then_averify_runs_off_the_event_loop_thread() -> None:
    loop_thread = threading.current_thread()
    hasher = RecordingHasher(context=_fast_context("argon2"))
    stored = hasher.hash(SECRET)
    assert (await hasher.averify(OTHER_SECRET, stored)).ok is False
    assert hasher.threads
    assert all(thread is not loop_thread for thread in hasher.threads)


async def test_if_verified_once_then_second_averify_is_served_from_cache() -> None:
    hasher = RecordingHasher(context=_fast_context("pbkdf2_sha256"))
    stored = hasher.hash(SECRET)
    assert await hasher.averify(SECRET, stored) == Verification(True, None)
    assert await hasher.averify(SECRET, stored) == Verification(True, None)
    assert len(hasher.threads) == 1


async def test_if_stored_hash_changes_then_cache_misses() -> None:
    # A rolled key (or any new hash of the same secret) is checked again, never cached.
    hasher = RecordingHasher(context=_fast_context("pbkdf2_sha256"))
    first, second = hasher.hash(SECRET), hasher.hash(SECRET)
    assert first != second  # salted
    assert (await hasher.averify(SECRET, first)).ok
    assert (await hasher.averify(SECRET, second)).ok
    assert len(hasher.threads) == 2


async def test_if_secret_wrong_then_averify_is_never_cached() -> None:
    hasher = RecordingHasher(context=_fast_context("pbkdf2_sha256"))
    stored = hasher.hash(SECRET)
    assert (await hasher.averify(OTHER_SECRET, stored)).ok is False
    assert (await hasher.averify(OTHER_SECRET, stored)).ok is False
    assert len(hasher.threads) == 2


async def test_if_right_secret_cached_then_wrong_secret_still_refused() -> None:
    hasher = RecordingHasher(context=_fast_context("pbkdf2_sha256"))
    stored = hasher.hash(SECRET)
    assert (await hasher.averify(SECRET, stored)).ok
    assert (await hasher.averify(OTHER_SECRET, stored)).ok is False
    assert (await hasher.averify(SECRET[:-1], stored)).ok is False


async def test_if_verify_asks_for_rehash_then_averify_does_not_cache_it() -> None:
    pbkdf2_hash = Hasher(context=_fast_context("pbkdf2_sha256")).hash(SECRET)
    hasher = RecordingHasher(context=_fast_context("argon2", "pbkdf2_sha256"))
    first = await hasher.averify(SECRET, pbkdf2_hash)
    second = await hasher.averify(SECRET, pbkdf2_hash)
    assert first.ok
    assert second.ok
    assert first.new_hash is not None
    assert first.new_hash.startswith("$argon2")
    assert second.new_hash is not None
    assert second.new_hash.startswith("$argon2")
    assert len(hasher.threads) == 2


async def test_if_cache_size_zero_then_every_averify_verifies() -> None:
    hasher = RecordingHasher(context=_fast_context("pbkdf2_sha256"), cache_size=0)
    stored = hasher.hash(SECRET)
    for _ in range(3):
        assert (await hasher.averify(SECRET, stored)).ok
    assert len(hasher.threads) == 3


async def test_if_fast_hash_then_averify_gives_the_same_answer_as_verify() -> None:
    hasher = Hasher(PEPPER, old_peppers=[OLD_PEPPER])
    current = hasher.hash(SECRET)
    old = Hasher(OLD_PEPPER).hash(SECRET)
    assert await hasher.averify(SECRET, current) == hasher.verify(SECRET, current)
    assert await hasher.averify(OTHER_SECRET, current) == Verification(False, None)
    assert await hasher.averify(SECRET, old) == hasher.verify(SECRET, old)


def test_if_hash_is_current_then_its_matcher_answers_as_verify_and_others_have_none() -> None:
    hasher = Hasher(PEPPER)
    current = hasher.hash(SECRET)
    matches = hasher.matcher(current)
    assert matches is not None
    assert matches(SECRET) is hasher.verify(SECRET, current).ok is True
    assert matches(OTHER_SECRET) is hasher.verify(OTHER_SECRET, current).ok is False
    # A hash names no pepper: another pepper's hash is simply one that never matches.
    unknown = Hasher("w7YSJZLiAYxEWR2oxzmwPNoaCxmAUO8mQTFT7uk7nZk").hash(SECRET)
    other = hasher.matcher(unknown)
    assert other is not None
    assert other(SECRET) is hasher.verify(SECRET, unknown).ok is False
    # Anything a match would not settle alone: a hash that a retired pepper may have made
    # (it moves to the current one), a hash without a pepper, a slow one.
    rotating = Hasher(PEPPER, old_peppers=[OLD_PEPPER])
    assert rotating.matcher(Hasher(OLD_PEPPER).hash(SECRET)) is None
    assert rotating.matcher(current) is None
    assert hasher.matcher("sha256$" + hashlib.sha256(SECRET.encode()).hexdigest()) is None
    assert hasher.matcher(Hasher(context=_fast_context("pbkdf2_sha256")).hash(SECRET)) is None
    # With a slow scheme preferred, a match asks for a re-hash: no matcher either.
    slow = Hasher(PEPPER, context=_fast_context("pbkdf2_sha256"))
    assert slow.matcher(current) is None


# -- never showing the pepper -----------------------------------------------------------------


def test_if_hasher_printed_then_pepper_is_hidden() -> None:
    hasher = Hasher(PEPPER, old_peppers=[OLD_PEPPER])
    for text in (repr(hasher), str(hasher), f"{hasher!r}"):
        assert PEPPER not in text
        assert OLD_PEPPER not in text
        assert PEPPER[:16] not in text


# -- the manager migrates hashes end to end ---------------------------------------------------


def test_if_a_pepper_is_set_then_an_unpeppered_hash_is_refused_unless_allowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A hash made without a pepper (a process that forgot APIKEYS_PEPPER) is not silently
    # accepted, and upgraded, by a peppered one: only when the application says so.
    unpeppered = "sha256$" + hashlib.sha256(SECRET.encode()).hexdigest()
    with caplog.at_level(logging.WARNING, logger="apikeys"):
        refused = Hasher(PEPPER).verify(SECRET, unpeppered)
    assert refused == Verification(False)
    [warning] = [r.getMessage() for r in caplog.records if r.name == "apikeys"]
    assert "without a pepper" in warning
    assert "allow_unpeppered=True" in warning
    allowed = Hasher(PEPPER, allow_unpeppered=True).verify(SECRET, unpeppered)
    assert allowed.ok
    assert allowed.new_hash == Hasher(PEPPER).hash(SECRET)
    # Without a pepper there is nothing to upgrade to: such hashes verify as before.
    assert Hasher().verify(SECRET, unpeppered).ok


async def test_if_key_made_without_pepper_then_peppered_manager_refuses_it_by_default() -> None:
    store = MemoryStore()
    unpeppered = KeyManager(store, hasher=Hasher())
    created = await unpeppered.create(name="legacy", scopes=["contacts:read"])
    peppered = KeyManager(store, hasher=Hasher(PEPPER))
    try:
        with pytest.raises(InvalidAPIKey):
            await peppered.verify(created.key)
        after = await store.get(created.record.id)
        assert after is not None
        assert after.secret_hash.startswith("sha256$")  # not upgraded behind anyone's back
    finally:
        await peppered.aclose()
        await unpeppered.aclose()


async def test_if_key_made_without_pepper_then_peppered_manager_verifies_and_migrates_it() -> None:
    store = MemoryStore()
    unpeppered = KeyManager(store, hasher=Hasher())
    created = await unpeppered.create(name="legacy", scopes=["contacts:read"])
    key_id = created.record.id
    before = await store.get(key_id)
    assert before is not None
    assert before.secret_hash.startswith("sha256$")

    peppered = KeyManager(store, hasher=Hasher(PEPPER, allow_unpeppered=True))
    try:
        record = await peppered.verify(created.key)
        assert record.id == key_id
        after = await store.get(key_id)
        assert after is not None
        assert after.secret_hash.startswith("hmac-sha256$")
        assert after.secret_hash == Hasher(PEPPER).hash(parse_secret(created.key))
        # The migrated key keeps working, and a wrong secret with its id still fails.
        assert (await peppered.verify(created.key)).id == key_id
        with pytest.raises(InvalidAPIKey):
            await peppered.verify(_other_key(created.key))
    finally:
        await peppered.aclose()
        await unpeppered.aclose()


async def test_if_key_made_with_old_pepper_then_manager_migrates_it_to_current() -> None:
    store = MemoryStore()
    old = KeyManager(store, hasher=Hasher(OLD_PEPPER))
    created = await old.create(name="rotated", full_access=True)
    current = KeyManager(store, hasher=Hasher(PEPPER, old_peppers=[OLD_PEPPER]))
    try:
        await current.verify(created.key)
        after = await store.get(created.record.id)
        assert after is not None
        assert after.secret_hash == Hasher(PEPPER).hash(parse_secret(created.key))
    finally:
        await current.aclose()
        await old.aclose()


def parse_secret(token: str) -> str:
    return parse_key(token).secret


def _other_key(token: str) -> str:
    """A well-formed key with the same prefix and id as `token` but another secret."""
    parsed = parse_key(token)
    other_secret = parsed.secret[:-1] + ("A" if parsed.secret[-1] != "A" else "B")
    return ParsedKey(parsed.prefix, parsed.id, other_secret).token


async def test_if_slow_hash_cached_then_revocation_still_refuses_the_key() -> None:
    manager = KeyManager(MemoryStore(), hasher=Hasher(context=_fast_context("pbkdf2_sha256")))
    try:
        created = await manager.create(name="slow", scopes=["contacts:read"])
        await manager.verify(created.key)
        await manager.verify(created.key)  # now in the verification cache
        await manager.revoke(created.record.id)
        with pytest.raises(KeyRevoked):
            await manager.verify(created.key)
    finally:
        await manager.aclose()


def test_if_old_peppers_in_environment_then_their_hashes_verify_and_migrate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old = Hasher(pepper="CXP5RfH1TH_udFKIlHGK38EBibcdYAdtGNZ1KcmWp5E")
    stored = old.hash("s" * 32)
    monkeypatch.setenv("APIKEYS_PEPPER", "_V2lky_a8YPokpK4lGq7-6cKtNEigzviXeROlzMUztw")
    monkeypatch.setenv(
        "APIKEYS_OLD_PEPPERS",
        "EeTWug_wTSi4d1rtNSoPiHTxQhcxnoBF9sW7TsxEy0Y,CXP5RfH1TH_udFKIlHGK38EBibcdYAdtGNZ1KcmWp5E",
    )
    result = Hasher().verify("s" * 32, stored)
    assert result.ok
    assert result.new_hash is not None
    assert result.new_hash == Hasher(pepper="_V2lky_a8YPokpK4lGq7-6cKtNEigzviXeROlzMUztw").hash(
        "s" * 32
    )


@pytest.mark.parametrize(
    "damage",
    [
        str.upper,
        lambda digest: digest[:2] + " " + digest[2:],
        lambda digest: digest[:-1],
        lambda digest: digest + "0",
        lambda digest: digest + "\n",
    ],
    ids=["uppercase", "space", "short", "long", "newline"],
)
def test_if_stored_hmac_hash_altered_then_it_never_matches(damage: object) -> None:
    # The parsed form of a stored hash is remembered: only the exact text this module
    # writes may match, as when the hex digests were compared as text.
    hasher = Hasher(PEPPER)
    stored = hasher.hash(SECRET)
    head, _, digest = stored.rpartition("$")
    altered = f"{head}${damage(digest)}"  # type: ignore[operator]
    for _ in range(2):  # first parse, then the remembered parse
        assert hasher.verify(SECRET, altered) == Verification(False, None)
        assert hasher.verify(SECRET, stored) == Verification(True, None)


@settings(max_examples=200, deadline=None)
@given(stored=st.text(max_size=120), secret=st.text(max_size=40))
def test_if_stored_hash_arbitrary_then_verify_refuses_and_answers_the_same_twice(
    stored: str, secret: str
) -> None:
    hasher = Hasher(PEPPER)
    first = hasher.verify(secret, stored)
    assert first == hasher.verify(secret, stored)
    assert first == Verification(False, None)


@settings(max_examples=100, deadline=None)
@given(
    secret=st.text(
        alphabet="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
        min_size=1,
        max_size=40,
    )
)
def test_if_secret_differs_by_anything_then_remembered_hash_refuses_it(secret: str) -> None:
    hasher = Hasher(PEPPER, old_peppers=[OLD_PEPPER])
    for stored in (hasher.hash(SECRET), Hasher(OLD_PEPPER).hash(SECRET)):
        assert hasher.verify(SECRET, stored).ok
        assert hasher.verify(secret, stored).ok is (secret == SECRET)


# -- the security review: slow-hash work that anonymous traffic can cause -------------------


class CountingHasher(Hasher):
    """Counts slow verifications and the most that ran at once."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.calls = 0
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()

    def verify(self, secret: str, stored: str) -> Verification:
        with self._lock:
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.01)  # long enough for concurrent calls to overlap
            return super().verify(secret, stored)
        finally:
            with self._lock:
                self.running -= 1


async def test_if_forged_secrets_flood_one_id_then_slow_hashing_stops_at_the_budget() -> None:
    # Finding 9: 16 forged secrets for a public id cost 16 argon2 verifications.
    hasher = CountingHasher(context=_fast_context("argon2"), failure_budget=5)
    stored = hasher.hash(SECRET)
    assert (await hasher.averify(SECRET, stored)).ok  # the owner, before the attack
    hasher.calls = 0
    forged = [SECRET[:-4] + f"{n:04d}" for n in range(16)]
    verdicts = await asyncio.gather(*(hasher.averify(secret, stored) for secret in forged))
    assert not any(verdict.ok for verdict in verdicts)
    assert hasher.calls <= 5
    # The owner's secret, verified before, still passes and costs nothing.
    calls = hasher.calls
    assert (await hasher.averify(SECRET, stored)).ok
    assert hasher.calls == calls


async def test_if_slow_verifications_pile_up_then_only_a_few_run_at_once() -> None:
    hasher = CountingHasher(context=_fast_context("pbkdf2_sha256"), slow_concurrency=2)
    stored = [hasher.hash(f"{SECRET[:-2]}{n:02d}") for n in range(12)]
    await asyncio.gather(*(hasher.averify(OTHER_SECRET, one) for one in stored))
    assert hasher.calls == 12
    assert hasher.most <= 2


async def test_if_the_budget_window_passes_then_the_id_is_checked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hasher = CountingHasher(context=_fast_context("pbkdf2_sha256"), failure_budget=2)
    stored = hasher.hash(SECRET)
    for _ in range(4):
        assert not (await hasher.averify(OTHER_SECRET, stored)).ok
    assert hasher.calls == 2
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 61)
    assert (await hasher.averify(SECRET, stored)).ok
    assert hasher.calls == 3


@pytest.mark.parametrize(
    "options", [{"slow_concurrency": 0}, {"failure_budget": 0}, {"failure_window": 0}]
)
def test_if_slow_bounds_are_not_positive_then_refused(options: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        Hasher(pepper=PEPPER, **options)  # type: ignore[arg-type]


def test_derive_is_hmac_sha256_of_purpose_and_nonce_under_the_named_pepper() -> None:
    hasher = Hasher(PEPPER, old_peppers=[OLD_PEPPER])
    old_id = Hasher(OLD_PEPPER, old_peppers=[]).pepper_fingerprint
    made = hasher.derive("webhook secret", "n1")
    expected = hmac.new(PEPPER.encode(), b"apikeys webhook secret|n1", hashlib.sha256).digest()
    assert made == (hasher.pepper_fingerprint, expected)
    by_old = hasher.derive("webhook secret", "n1", old_id)
    expected_old = hmac.new(
        OLD_PEPPER.encode(), b"apikeys webhook secret|n1", hashlib.sha256
    ).digest()
    assert by_old == (old_id, expected_old)
    assert hasher.derive("webhook secret", "n2") != made
    assert hasher.derive("other use", "n1") != made


def test_derive_without_the_named_pepper_is_none_and_never_shows_a_pepper() -> None:
    hasher = Hasher(PEPPER, old_peppers=[])
    assert hasher.derive("webhook secret", "n1", "00000000") is None
    assert Hasher(old_peppers=[]).derive("webhook secret", "n1") is None
    assert Hasher(old_peppers=[OLD_PEPPER]).derive("webhook secret", "n1") is None
    made = hasher.derive("webhook secret", "n1")
    assert made is not None
    assert PEPPER.encode() not in made[1]
    assert PEPPER not in made[0]
    with pytest.raises(ValueError, match=r"\|"):
        hasher.derive("webhook|secret", "n1")
