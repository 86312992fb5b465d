"""How secrets are hashed at rest, and checked.

Why a fast keyed hash is the right default: an API key secret is 32 random base62
characters, about 190 bits of entropy. Slow password hashes (argon2, bcrypt) exist to make
guessing *low-entropy human passwords* expensive; nobody can enumerate 2**190 candidates,
fast hash or not. So the default is HMAC-SHA256 keyed with a server-side pepper
(`APIKEYS_PEPPER`): a stolen database alone does not even let an attacker test a guessed
key, and verifying costs about a microsecond instead of tens of milliseconds. Without a
pepper the fallback is plain SHA-256, with a logged warning.

Stored hashes describe their scheme, so schemes can change under a running system:

- `hmac-sha256$<hex>`: keyed with the pepper. The hash names no pepper: a label derived
  from the pepper would let anyone holding the database confirm a guessed pepper offline.
  It is checked with the current pepper, then with each retired one (`old_peppers`).
  (`hmac-sha256$<pepper id>$<hex>`, the form of earlier versions, still verifies with the
  pepper it names, and is replaced on its next use.)
- `sha256$<hex>`: no pepper;
- anything passlib recognises (`$argon2id$…`, `$2b$…`, `$pbkdf2-sha256$…`): slow schemes,
  opt-in through a passlib `CryptContext`;
- `imported$<an old system's hash>`: a key brought in by `apikeys import`, checked as any
  slow scheme is (`apikeys.importing.foreign`), or at once for a plain digest of the whole
  key, and re-hashed on its first use.

A hash in a scheme that is no longer the preferred one (unpeppered SHA-256 once a pepper is
set, an old pepper, a deprecated passlib scheme) is replaced on its next successful use.
Slow schemes run in a worker thread, never on the event loop, and a short-lived cache of
verified (hash, secret) pairs spares repeat requests the cost. The cache is keyed by the
stored hash, so a rolled key misses it, and it only ever answers "this secret matches this
hash": whether the key is usable is decided from its record on every request, so
revocation is never served from the cache.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import math
import os
import re
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from apikeys.bounded import remember, remember_recent
from apikeys.errors import ConfigurationError

if TYPE_CHECKING:
    from passlib.context import CryptContext

__all__ = ["OLD_PEPPERS_ENV", "PEPPER_ENV", "Hasher", "Verification", "slow_context"]

logger = logging.getLogger("apikeys")

PEPPER_ENV = "APIKEYS_PEPPER"
OLD_PEPPERS_ENV = "APIKEYS_OLD_PEPPERS"
MIN_PEPPER_LENGTH = 16
"""The shortest retired pepper (`old_peppers`) accepted, in bytes."""
STRONG_PEPPER_LENGTH = 32
"""The shortest current pepper accepted, in bytes, and it must also look random."""
PEPPER_HINT = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'
# A current pepper: at least this many bits by zxcvbn's estimate of the guesses it takes,
# and at most this share of it in words, names, sequences, repeats or dates of 4 or more
# characters. (Over 1,500 draws of secrets.token_urlsafe(32): at least 135 bits, and at
# most 0.38 in such matches; dictionary phrases of 32 characters or more: at least 0.65.)
_MIN_PEPPER_BITS = 100
# Hex digits alone: 32 random ones (128 bits, `openssl rand -hex 16`) score 89 bits and up
# (400 draws), any run or repeat of them at most 64.
_MIN_HEX_PEPPER_BITS = 80
_MAX_PEPPER_WORDS = 0.5
_HEX_RE = re.compile(r"[0-9a-fA-F]+")
UNPEPPERED = "unpeppered"
"""The pepper fingerprint of a hasher without a pepper."""
_HMAC_SCHEME = "hmac-sha256$"
_SHA256_SCHEME = "sha256$"
_IMPORTED = "imported$"  # apikeys.importing.foreign.IMPORTED: an old system's hash
# Imported plain digests of the whole key (sha256:, sha512:, and djangorestframework-api-key's
# sha512$$): checked in microseconds, as this module's own schemes are.
_IMPORTED_DIGESTS = ("imported$sha256:", "imported$sha512:", "imported$sha512$$")


class Verification(NamedTuple):
    """The outcome of checking a secret: did it match, and the hash to store instead.

    `stale` says the stored hash should move to a slow scheme: the caller makes that hash
    with `ahash`, off the event loop, since `verify` must not block for it.
    """

    ok: bool
    new_hash: str | None = None
    stale: bool = False


class _HMACKey:
    """HMAC-SHA256 (RFC 2104) with the padded key's hash states computed once.

    Copying two prepared SHA-256 states costs about half of `hmac.HMAC.copy()`, and this
    runs on every request.
    """

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > 64:
            key = hashlib.sha256(key).digest()
        key = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(byte ^ 0x36 for byte in key))
        self._outer = hashlib.sha256(bytes(byte ^ 0x5C for byte in key))

    def digest(self, message: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(message)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def hexdigest(self, message: bytes) -> str:
        return self.digest(message).hex()


# A stored HMAC hash, parsed: its digest, and each pepper's key that may have made it, in
# the order they are tried, with the answer on a match.
_Parsed = tuple[bytes, tuple[tuple[_HMACKey, "Verification | None"], ...]]

# The two answers of the hot path, allocated once.
_MATCH = Verification(True)
_MATCH_STALE = Verification(True, stale=True)
_NO_MATCH = Verification(False)
_PARSED_LIMIT = 100_000


# Stored hashes whose recent failures are remembered (least recently failed forgotten first).
_MAX_TRACKED_FAILURES = 10_000


def _pepper_id(pepper: bytes) -> str:
    # Names the pepper in stored hashes without revealing anything usable about it.
    return hmac.new(pepper, b"apikeys pepper id", hashlib.sha256).hexdigest()[:8]


def _check_strength(pepper: bytes) -> None:
    """Refuse a current pepper that could be guessed (`ConfigurationError`).

    The store holds values derived from the pepper that confirm a guess of it offline (the
    pepper fingerprint `KeyManager` records to refuse a wrong pepper at startup, the
    pepper id of sealed webhook secrets): harmless only when guessing is hopeless. So a
    pepper is at least 32 bytes, and as text it must look random: zxcvbn's estimate of the
    guesses it takes at least 2**100 (2**80 for hex digits alone), and words, names,
    keyboard runs, sequences, repeats and dates no more than half of it. Text is judged
    without its whitespace and control characters (a trailing newline, a tab), which add
    nothing a guess must find, and must be ASCII (the word lists are English). Random bytes
    (not UTF-8 text) need 32 bytes of at least 16 distinct values.
    """
    message = (
        f"the pepper ({PEPPER_ENV}) must be at least {STRONG_PEPPER_LENGTH} bytes of random "
        "text, and this one {why}: anyone holding the database could guess it and confirm "
        f"the guess offline. Generate one with: {PEPPER_HINT}"
    )
    if len(pepper) < STRONG_PEPPER_LENGTH:
        raise ConfigurationError(message.format(why=f"is {len(pepper)} bytes"))
    try:
        text = pepper.decode("utf-8")
    except UnicodeDecodeError:
        if len(set(pepper)) < STRONG_PEPPER_LENGTH // 2:
            raise ConfigurationError(message.format(why="repeats its bytes")) from None
        return
    visible = "".join(char for char in text if char.isprintable() and not char.isspace())
    if not visible.isascii():
        # zxcvbn knows English words only: a phrase in another language would pass it.
        raise ConfigurationError(message.format(why="is text that is not ASCII"))
    if len(visible.encode()) < STRONG_PEPPER_LENGTH:
        why = f"has {len(visible.encode())} bytes besides whitespace and control characters"
        raise ConfigurationError(message.format(why=why))
    bits, words = _guessability(hashlib.sha256(pepper).digest(), visible)
    least = _MIN_HEX_PEPPER_BITS if _HEX_RE.fullmatch(visible[:72]) else _MIN_PEPPER_BITS
    if bits < least or words > _MAX_PEPPER_WORDS:
        raise ConfigurationError(message.format(why="reads as words, sequences or repeats"))


# Peppers already judged, by their SHA-256 (so the pepper is not kept here): zxcvbn takes
# tens of milliseconds, and processes make hashers with the same pepper again and again.
_JUDGED: dict[bytes, tuple[float, float]] = {}


def _guessability(key: bytes, text: str) -> tuple[float, float]:
    """zxcvbn's estimate for `text`: bits of guesses, and the share of its characters inside
    any word, name, keyboard run, sequence, repeat or date of 4 or more characters that
    zxcvbn finds (0 for hex digits alone, where such runs are common by chance and zxcvbn's
    guesses already tell a repeated hex word). Only the first 72 characters are read, the
    most zxcvbn takes (its matching grows with the square of the length)."""
    judged = _JUDGED.get(key)
    if judged is None:
        from zxcvbn import zxcvbn  # type: ignore[import-untyped]
        from zxcvbn.matching import omnimatch  # type: ignore[import-untyped]

        sample = text[:72]
        covered: set[int] = set()
        if _HEX_RE.fullmatch(sample) is None:
            for match in omnimatch(sample):
                if match["j"] - match["i"] >= 3:
                    covered.update(range(match["i"], match["j"] + 1))
        guesses_log10 = float(zxcvbn(sample)["guesses_log10"])
        judged = (guesses_log10 * math.log2(10), len(covered) / len(sample))
        if len(_JUDGED) < 1_000:
            _JUDGED[key] = judged
    return judged


def slow_context(*schemes: str) -> CryptContext:
    """A passlib `CryptContext` whose first scheme hashes new keys (default argon2).

    Needs the passlib extra: `pip install 'apikeys[passlib]'`.
    """
    try:
        from passlib.context import CryptContext
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigurationError(
            "slow hash schemes need libpass. Install it with: pip install 'apikeys[passlib]'"
        ) from exc
    chosen = list(schemes or ("argon2",))
    return CryptContext(schemes=chosen, deprecated="auto")


def _matches(
    inner_state: Any,
    outer_state: Any,
    digest: bytes,
    secret: str,
    compare: Callable[[bytes, bytes], bool] = hmac.compare_digest,
) -> bool:
    """`Hasher.matcher`'s check: `_HMACKey.digest`, written out (it runs on every request)."""
    inner = inner_state.copy()
    inner.update(secret.encode())
    outer = outer_state.copy()
    outer.update(inner.digest())
    return compare(outer.digest(), digest)


class Hasher:
    """Hashes secrets for storage and checks secrets against stored hashes.

    `Hasher()` reads the pepper from `APIKEYS_PEPPER` and retired peppers from
    `APIKEYS_OLD_PEPPERS` (comma-separated). The pepper must be random, at least 32 bytes
    that do not read as words or sequences (`ConfigurationError` otherwise, naming the
    command that makes one); a retired one needs only 16 bytes. Pass `pepper=` to set it in code,
    `old_peppers=` to keep verifying (and migrating) hashes made with retired peppers, and
    `context=` (a passlib `CryptContext`, see `slow_context`) to hash new keys with a slow
    scheme instead.

    With a pepper, a hash made without one (`sha256$…`: a process that ran without
    `APIKEYS_PEPPER`) is refused, with a logged warning, unless `allow_unpeppered=True`
    says the application is moving such keys to the pepper: then it verifies and is
    re-hashed with the pepper on its next use.

    Slow verifications are bounded, since anyone can send secrets for a public key id: at
    most `slow_concurrency` run at once per event loop, and a stored hash that failed
    `failure_budget` times within `failure_window` seconds refuses secrets not already
    verified in this process, without hashing them, until the window ends.
    """

    def __init__(
        self,
        pepper: str | bytes | None = None,
        *,
        old_peppers: Sequence[str | bytes] | None = None,
        context: CryptContext | None = None,
        cache_size: int = 10_000,
        cache_ttl: float = 300.0,
        slow_concurrency: int = 2,
        failure_budget: int = 10,
        failure_window: float = 60.0,
        allow_unpeppered: bool = False,
    ) -> None:
        self._allow_unpeppered = allow_unpeppered
        self._warned_unpeppered = False
        self._warned_imported = False
        if pepper is None:
            pepper = os.environ.get(PEPPER_ENV) or None
        if old_peppers is None:
            old_peppers = [p for p in os.environ.get(OLD_PEPPERS_ENV, "").split(",") if p]
        self._pepper = self._coerce(pepper) if pepper is not None else None
        if self._pepper is not None:
            _check_strength(self._pepper)
        # pepper id -> its key, the current pepper first. The ids name peppers in the store's
        # pepper record and in sealed webhook secrets, never in a key's hash.
        self._peppers: dict[str, _HMACKey] = {}
        for candidate in (self._pepper, *(self._coerce(p) for p in old_peppers)):
            if candidate is not None:
                self._peppers.setdefault(_pepper_id(candidate), _HMACKey(candidate))
        self._current_id = _pepper_id(self._pepper) if self._pepper is not None else None
        self._context = context
        # stored HMAC hash -> (the digest as bytes, each pepper's key that may have made it
        # with the answer on a match); parsed once per stored hash instead of on every
        # request. (None as an answer: a hash to replace, whose answer carries the new hash.)
        self._parsed: dict[str, _Parsed | None] = {}
        self._cache: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._cache_size = cache_size
        self._cache_ttl = cache_ttl
        # Keys the cache by a keyed digest, so a memory dump shows no secret.
        self._cache_key = hmac.new(os.urandom(32), None, hashlib.sha256)
        # Bounds on the slow-hash work that anyone can cause with a public key id: slow
        # verifications running at once (per event loop), and failures per stored hash.
        if slow_concurrency < 1 or failure_budget < 1 or failure_window <= 0:
            raise ConfigurationError(
                "slow_concurrency and failure_budget take at least 1, failure_window > 0"
            )
        self._slow_concurrency = slow_concurrency
        self._slow_slots: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Semaphore
        ] = weakref.WeakKeyDictionary()
        self._failure_budget = failure_budget
        self._failure_window = failure_window
        # stored hash -> (failures, when the window of those failures started)
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()
        if self._pepper is None and context is None:
            logger.warning(
                "apikeys: %s is not set; secrets are hashed with unkeyed SHA-256. "
                "Set a random pepper of at least %d characters in production.",
                PEPPER_ENV,
                MIN_PEPPER_LENGTH,
            )

    @staticmethod
    def _coerce(pepper: str | bytes) -> bytes:
        raw = pepper.encode() if isinstance(pepper, str) else bytes(pepper)
        if len(raw) < MIN_PEPPER_LENGTH:
            raise ConfigurationError(
                f"the pepper must be at least {MIN_PEPPER_LENGTH} bytes; "
                f"generate one with: {PEPPER_HINT}"
            )
        return raw

    def __repr__(self) -> str:
        return f"Hasher(scheme={self.scheme!r})"

    @property
    def pepper_fingerprint(self) -> str:
        """What names this hasher's pepper in the store (`KeyManager` records it there): the
        pepper's id, 8 hex digits of an HMAC of it, or `unpeppered`.

        Never the pepper; but it confirms a guessed pepper offline, as any check of the
        pepper against the store must: that is why a pepper must be random
        (`ConfigurationError` otherwise). Key hashes do not show it.
        """
        return self._current_id or UNPEPPERED

    @property
    def old_pepper_fingerprints(self) -> tuple[str, ...]:
        """The fingerprints of the retired peppers this hasher still verifies (and, with
        `allow_unpeppered`, `unpeppered`): a store recording one of them moves to this one."""
        retired = tuple(key for key in self._peppers if key != self._current_id)
        if self._current_id is not None and self._allow_unpeppered:
            retired += (UNPEPPERED,)
        return retired

    def derive(
        self, purpose: str, nonce: str, pepper_id: str | None = None
    ) -> tuple[str, bytes] | None:
        """32 bytes that only a holder of a pepper can make, for secrets that are made
        again whenever they are needed instead of being stored (webhook signing secrets,
        `apikeys.webhooks.signing`): HMAC-SHA256 of `apikeys {purpose}|{nonce}` keyed with
        the pepper named `pepper_id` (the current one when None), and that pepper's id.

        None when this hasher has no such pepper: none at all, or `pepper_id` names
        neither its pepper nor one of its `old_peppers`. The store keeps the pepper's id
        and the nonce; never the bytes, and the pepper never leaves the hasher. `purpose`
        (without `|`) separates the uses; its message holds a space, which neither a key's
        secret (base62) nor an imported key's string (printable, without spaces) has, so
        no key's hash is ever the same HMAC.
        """
        if "|" in purpose:
            raise ValueError("a purpose has no '|'")
        chosen = self._current_id if pepper_id is None else pepper_id
        base = self._peppers.get(chosen) if chosen is not None else None
        if chosen is None or base is None:
            return None
        return chosen, base.digest(f"apikeys {purpose}|{nonce}".encode())

    @property
    def scheme(self) -> str:
        """The scheme new hashes are made with."""
        if self._context is not None:
            return str(self._context.default_scheme())
        return "hmac-sha256" if self._pepper is not None else "sha256"

    def hash(self, secret: str) -> str:
        """Hash a secret for storage, in the preferred scheme."""
        if self._context is not None:
            return str(self._context.hash(secret))
        return self._fast_hash(secret)

    async def ahash(self, secret: str) -> str:
        """`hash`, in a worker thread when the preferred scheme is a slow one."""
        if self._context is None:
            return self._fast_hash(secret)
        return await asyncio.to_thread(self.hash, secret)

    def _fast_hash(self, secret: str) -> str:
        if self._current_id is not None:
            return _HMAC_SCHEME + self._peppers[self._current_id].hexdigest(secret.encode())
        return _SHA256_SCHEME + hashlib.sha256(secret.encode()).hexdigest()

    def is_fast(self, stored: str) -> bool:
        """True when `stored` is checked in microseconds (no thread needed, and no failure
        budget: there is no CPU to bound): this hasher's own schemes, and imported plain
        digests."""
        return stored.startswith((_HMAC_SCHEME, _SHA256_SCHEME, *_IMPORTED_DIGESTS))

    def verify_fast(self, secret: str, stored: str) -> Verification | None:
        """`verify` for a hash of this hasher's fast schemes; None for any other hash (then
        `verify`, or `averify` for a slow one). The cached request path's check."""
        try:
            parsed = self._parsed[stored]
        except KeyError:
            parsed = None
        if parsed is None:
            # Not yet parsed, or parsed as no HMAC of a known pepper: `verify` remembers
            # every hash it was given, slow ones included, and those are never checked here.
            if not stored.startswith((_HMAC_SCHEME, _SHA256_SCHEME)):
                return None
            return self.verify(secret, stored)
        digest, candidates = parsed
        encoded = secret.encode()
        for base, on_match in candidates:
            # _HMACKey.digest, written out: this runs on every request.
            inner = base._inner.copy()
            inner.update(encoded)
            outer = base._outer.copy()
            outer.update(inner.digest())
            if hmac.compare_digest(outer.digest(), digest):
                return on_match or Verification(True, self._fast_hash(secret))
        return _NO_MATCH

    def matcher(self, stored: str) -> Callable[[str], bool] | None:
        """A check of secrets against `stored`, prepared once for a hash that needs nothing
        else on a match: an HMAC of this hasher's current pepper, with no slow scheme
        preferred. None for any other hash (then `verify_fast`, `verify` or `averify`).

        `matcher(stored)(secret)` answers what `verify(secret, stored).ok` answers, in
        constant time, without looking the hash up again: `KeyManager.verify_now` makes one
        per version of a key it holds.
        """
        try:
            parsed = self._parsed[stored]
        except KeyError:
            parsed = self._parse_hmac(stored)
        if parsed is None or len(parsed[1]) != 1 or parsed[1][0][1] is not _MATCH:
            return None  # more than one pepper to try, or a hash to replace on a match
        digest, ((base, _),) = parsed
        # A partial, not a closure: one is kept per cached key, and a partial of three
        # shared objects and the digest is a third of a closure's memory, as fast to call.
        return functools.partial(_matches, base._inner, base._outer, digest)

    def verify(self, secret: str, stored: str) -> Verification:
        """Check `secret` against `stored` in constant time. May block for slow schemes."""
        try:
            parsed = self._parsed[stored]
        except KeyError:
            parsed = self._parse_hmac(stored)
        if parsed is not None:
            digest, candidates = parsed
            encoded = secret.encode()
            for base, on_match in candidates:
                if hmac.compare_digest(base.digest(encoded), digest):
                    return on_match or Verification(True, self._fast_hash(secret))
            return _NO_MATCH
        if stored.startswith(_HMAC_SCHEME):  # a pepper this process does not know
            return _NO_MATCH
        if stored.startswith(_SHA256_SCHEME):
            plain = hashlib.sha256(secret.encode()).hexdigest()
            if not hmac.compare_digest(plain, stored[len(_SHA256_SCHEME) :]):
                return _NO_MATCH
            if self._pepper is not None and not self._allow_unpeppered:
                self._warn_unpeppered()
                return _NO_MATCH
            if self._context is not None:
                return _MATCH_STALE
            if self._pepper is not None:
                return Verification(True, self._fast_hash(secret))
            return _MATCH
        if stored.startswith(_IMPORTED):
            return self._verify_imported(secret, stored[len(_IMPORTED) :])
        try:
            return self._verify_slow(secret, stored)
        except Exception:
            # (ValueError, OverflowError from a count of rounds past the platform's, a
            # missing backend): fail closed, as a wrong secret.
            return _NO_MATCH

    def _verify_imported(self, token: str, original: str) -> Verification:
        """An imported key's old hash (`apikeys.importing`): on a match, the hash to keep
        instead is this hasher's own, of the whole old key string."""
        from apikeys.importing.foreign import verify_foreign

        try:
            ok = verify_foreign(token, original)
        except ConfigurationError as exc:
            # Fail closed, and say why once: the service lacks the extra imports need.
            if not self._warned_imported:
                self._warned_imported = True
                logger.error("apikeys: an imported key was refused: %s", exc)
            return _NO_MATCH
        if not ok:
            return _NO_MATCH
        if self._context is not None:
            return _MATCH_STALE
        return Verification(True, self._fast_hash(token))

    def _warn_unpeppered(self) -> None:
        if not self._warned_unpeppered:
            self._warned_unpeppered = True
            logger.warning(
                "apikeys: a key hashed without a pepper was refused: it was made by a process "
                "without %s. Give that process the pepper, or accept and upgrade such keys "
                "with Hasher(allow_unpeppered=True).",
                PEPPER_ENV,
            )

    def _parse_hmac(self, stored: str) -> _Parsed | None:
        """`stored` read as an HMAC hash this hasher's peppers may have made, or None
        (remembered either way)."""
        parsed = None
        if stored.startswith(_HMAC_SCHEME):
            label, _, hex_digest = stored[len(_HMAC_SCHEME) :].rpartition("$")
            try:
                digest = bytes.fromhex(hex_digest)
            except ValueError:
                digest = b""
            # Exactly what this module writes: 64 lowercase hex digits, nothing else.
            if len(digest) == 32 and digest.hex() == hex_digest:
                candidates = self._candidates(label)
                if candidates:
                    parsed = (digest, candidates)
        return remember(self._parsed, stored, parsed, _PARSED_LIMIT)

    def _candidates(self, label: str) -> tuple[tuple[_HMACKey, Verification | None], ...]:
        """The peppers' keys to try for an HMAC hash with `label` (empty: today's form,
        every pepper, the current first; else the pepper id that earlier versions wrote,
        that pepper alone), each with the answer on a match (None: replace the hash)."""
        if label:
            base = self._peppers.get(label)
            chosen = [] if base is None else [(label, base)]
        else:
            chosen = list(self._peppers.items())
        answers: list[tuple[_HMACKey, Verification | None]] = []
        for pepper_id, base in chosen:
            on_match: Verification | None = None
            if self._context is not None:
                on_match = _MATCH_STALE
            elif pepper_id == self._current_id and not label:
                on_match = _MATCH
            answers.append((base, on_match))
        return tuple(answers)

    def _verify_slow(self, secret: str, stored: str) -> Verification:
        context = self._context
        if context is None:
            context = _legacy_context()
            if context is None or not context.identify(stored):
                return Verification(False)
            # A hash this hasher did not make (another setup's, a row edited by hand) is
            # bounded in cost, as imported ones are: over the bound, no hashing at all.
            from apikeys.importing.foreign import cost_refusal

            if cost_refusal(stored) is not None:
                return Verification(False)
            ok = bool(context.verify(secret, stored))
            # Slow hashes are not the preferred scheme here: move to the fast one.
            return Verification(ok, self._fast_hash(secret) if ok else None)
        if not context.identify(stored):
            return Verification(False)
        ok, new_hash = context.verify_and_update(secret, stored)
        return Verification(bool(ok), new_hash)

    async def averify(self, secret: str, stored: str) -> Verification:
        """`verify`, but slow schemes run in a worker thread and recent matches are cached.

        Slow verifications are bounded: at most `slow_concurrency` run at once (others
        wait), and once a stored hash has failed `failure_budget` times within
        `failure_window` seconds, secrets not already verified in this process are refused
        for it without hashing until the window ends (docs/concepts/hashing.md).
        """
        if self.is_fast(stored):
            return self.verify(secret, stored)
        cache_key = self._cache_token(secret, stored)
        now = time.monotonic()
        expires = self._cache.get(cache_key)
        if expires is not None and expires > now:
            self._cache.move_to_end(cache_key)
            return Verification(True)
        failures = self._failures.get(stored)
        if failures is None or now - failures[1] >= self._failure_window:
            failures = (0, now)
        if failures[0] >= self._failure_budget:
            return Verification(False)  # guessing at a public id: no more CPU for it now
        # The attempt counts before it runs, so concurrent guesses cannot all slip past.
        remember_recent(
            self._failures, stored, (failures[0] + 1, failures[1]), _MAX_TRACKED_FAILURES
        )
        async with self._slots():
            result = await asyncio.to_thread(self.verify, secret, stored)
        if result.ok:
            self._failures.pop(stored, None)
            if result.new_hash is None and self._cache_size > 0:
                until = time.monotonic() + self._cache_ttl
                remember_recent(self._cache, cache_key, until, self._cache_size)
        return result

    def _slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        slots = self._slow_slots.get(loop)
        if slots is None:
            slots = self._slow_slots[loop] = asyncio.Semaphore(self._slow_concurrency)
        return slots

    def _cache_token(self, secret: str, stored: str) -> tuple[str, bytes]:
        mac = self._cache_key.copy()
        mac.update(secret.encode())
        return stored, mac.digest()


@functools.cache
def _legacy_context() -> CryptContext | None:
    """A context that can read every slow scheme, for hashes made under an older setup."""
    try:
        from passlib.context import CryptContext
    except ImportError:
        return None
    return CryptContext(schemes=["argon2", "bcrypt", "pbkdf2_sha256"])
