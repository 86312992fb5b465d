"""The pepper: a stored hash says nothing about it, so a stolen database cannot confirm a
guessed pepper from the keys' hashes."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apikeys.errors import ConfigurationError
from apikeys.hashing import PEPPER_ENV, Hasher, Verification

SECRET = "Vd2hR8sLk4NwQ1e9TfYb6GcJ0uMiPzXa"
PEPPER = "0vQ7Zl7mM2yWf0J3bq8cXr3Tq1K4d9sHcE6uYk2pN5A"
OTHER_PEPPER = "Jm4r8Tq1pW0Zc7Ks3Ld9Hx5Vb2Nf6Yg1Qa8Ue3Ri0Ot"


@pytest.fixture(autouse=True)
def _no_pepper_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEPPER_ENV, raising=False)


def _label(stored: str) -> str:
    """All of a stored hash but its digest."""
    return stored.rpartition("$")[0]


def test_if_peppers_differ_then_the_stored_hashes_labels_are_the_same() -> None:
    first, second = Hasher(PEPPER).hash(SECRET), Hasher(OTHER_PEPPER).hash(SECRET)
    assert first != second
    assert _label(first) == _label(second) == "hmac-sha256"


@given(st.sampled_from([PEPPER, OTHER_PEPPER]), st.text(min_size=1, max_size=40))
def test_nothing_in_a_stored_hash_but_the_digest_depends_on_the_pepper(
    pepper: str, secret: str
) -> None:
    stored = Hasher(pepper).hash(secret)
    label, _, digest = stored.rpartition("$")
    assert label == "hmac-sha256"
    # The digest confirms a guessed pepper only with the key's secret, which is not stored.
    assert digest == hmac.new(pepper.encode(), secret.encode(), hashlib.sha256).hexdigest()


def test_if_a_hash_of_an_old_pepper_is_given_then_it_verifies_and_moves_to_the_current() -> None:
    old_hash = Hasher(OTHER_PEPPER).hash(SECRET)
    rotating = Hasher(PEPPER, old_peppers=[OTHER_PEPPER])
    verdict = rotating.verify(SECRET, old_hash)
    assert verdict.ok
    assert verdict.new_hash == Hasher(PEPPER).hash(SECRET)
    assert rotating.verify(SECRET, verdict.new_hash) == Verification(True, None)
    assert rotating.verify_fast("x" + SECRET[1:], old_hash) == Verification(False, None)
    assert rotating.matcher(old_hash) is None  # its check needs more than one pepper
    assert not Hasher(PEPPER).verify(SECRET, old_hash).ok


def test_a_hash_in_the_labelled_form_of_earlier_versions_still_verifies_and_moves() -> None:
    hasher = Hasher(PEPPER)
    pepper_id = hmac.new(PEPPER.encode(), b"apikeys pepper id", hashlib.sha256).hexdigest()[:8]
    digest = hmac.new(PEPPER.encode(), SECRET.encode(), hashlib.sha256).hexdigest()
    labelled = f"hmac-sha256${pepper_id}${digest}"
    verdict = hasher.verify(SECRET, labelled)
    assert verdict.ok
    assert verdict.new_hash == hasher.hash(SECRET)
    assert not hasher.verify(SECRET, f"hmac-sha256$deadbeef${digest}").ok


def test_a_fresh_random_pepper_hashes_and_verifies() -> None:
    hasher = Hasher(secrets.token_urlsafe(32))
    stored = hasher.hash(SECRET)
    matches = hasher.matcher(stored)
    assert matches is not None
    assert matches(SECRET)
    assert not matches(SECRET[::-1])
    assert hasher.verify_fast(SECRET, stored) == Verification(True, None)


# -- a pepper that could be guessed is refused ---------------------------------------------

WORDS = [
    "correct",
    "horse",
    "battery",
    "staple",
    "pepper",
    "secret",
    "apikeys",
    "production",
    "service",
    "contacts",
    "password",
    "welcome",
    "dragon",
    "monkey",
    "sunshine",
    "princess",
    "football",
    "master",
    "shadow",
    "summer",
    "winter",
    "company",
    "deploy",
    "server",
    "cluster",
    "random",
    "change",
    "please",
    "quick",
    "brown",
    "jumps",
    "over",
    "lazy",
    "letmein",
    "admin",
    "default",
    "example",
    "test",
    "staging",
    "customer",
    "webhook",
    "token",
    "signing",
]


@st.composite
def phrases(draw: st.DrawFn) -> str:
    """Dictionary phrases as people make them: words, a separator, capitals, a number."""
    words = draw(st.lists(st.sampled_from(WORDS), min_size=2, max_size=12))
    if draw(st.booleans()):
        words = [word.capitalize() for word in words]
    phrase = draw(st.sampled_from(["-", "_", "", ".", " ", ", "])).join(words)
    if draw(st.booleans()):
        phrase += str(draw(st.integers(0, 99_999)))
    return phrase + draw(st.sampled_from(["", "!", "?", "#"]))


@given(phrases())
def test_if_a_pepper_is_a_dictionary_phrase_then_the_hasher_is_refused(phrase: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Hasher(phrase)
    message = str(caught.value)
    assert phrase not in message
    assert 'python -c "import secrets; print(secrets.token_urlsafe(32))"' in message


@pytest.mark.parametrize(
    "pepper",
    [
        "correct-horse-battery-staple",  # the docs' own example until now
        "test-pepper-0123456789abcdef",
        "p" * 32,
        b"p" * 32,
        "0123456789abcdef" * 4,
        "deadbeefcafebabe" * 4,
        "ThisIsMyVerySecretPepperForProductionUseOnly2024",
        bytes(32),
        # Whitespace and control characters add nothing a guess must find.
        "acme-production-apikeys-pepper-2026\n",
        "abcdefghijklmnopqrstuvwxyz0123456789\t",
        "correct horse battery staple correct horse\r\n",
        # A phrase in a language zxcvbn's English word lists do not know.
        "Größenwahn-Passwort-für-Produktion-2026",
    ],
)
def test_if_a_pepper_can_be_guessed_then_the_hasher_is_refused(pepper: str | bytes) -> None:
    with pytest.raises(ConfigurationError, match="token_urlsafe"):
        Hasher(pepper)


def test_if_the_env_pepper_can_be_guessed_then_the_hasher_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PEPPER_ENV, "correct-horse-battery-staple-correct-horse")
    with pytest.raises(ConfigurationError, match=PEPPER_ENV):
        Hasher()


def test_random_peppers_of_32_bytes_are_accepted() -> None:
    for _ in range(50):
        Hasher(secrets.token_urlsafe(32))
        Hasher(secrets.token_hex(32))
        Hasher(base64.b64encode(secrets.token_bytes(32)).decode())
        Hasher(secrets.token_bytes(32))
        Hasher(secrets.token_urlsafe(32) + "\n")  # read from a file, its newline kept


def test_32_random_hex_digits_are_accepted() -> None:
    # 128 bits (`openssl rand -hex 16`): zxcvbn scores some draws under 2**100, none under
    # 2**80, where every run or repeat of hex digits scores 2**64 at most.
    for _ in range(300):
        Hasher(secrets.token_hex(16))


def test_a_retired_pepper_needs_only_16_bytes_so_a_weak_one_can_be_rotated_away() -> None:
    old_hash_pepper = "the-old-weak-pepper-2024"
    rotating = Hasher(PEPPER, old_peppers=[old_hash_pepper])
    digest = hmac.new(old_hash_pepper.encode(), SECRET.encode(), hashlib.sha256).hexdigest()
    verdict = rotating.verify(SECRET, f"hmac-sha256${digest}")
    assert verdict.ok
    assert verdict.new_hash == Hasher(PEPPER).hash(SECRET)
