"""Keys made by another system: their hashes, and how their records are found.

An imported key keeps the hash its old system made, stored as `imported$<that hash>`, until
its first successful use re-hashes it with apikeys' own scheme. The "secret" of such a key
is the whole old key string: `prefix.secret` for djangorestframework-api-key, whatever the
old system issued otherwise.

Hashes are checked by passlib (libpass), never by hand:

- `sha512$$<hex>`: djangorestframework-api-key 2 and later (SHA-512 of the whole key);
- Django's password hashers, which older releases of it used: `pbkdf2_sha256$…`,
  `pbkdf2_sha1$…`, `argon2$…`, `bcrypt_sha256$…`, `bcrypt$…`;
- passlib's own formats: `$argon2id$…`, `$2b$…`, `$pbkdf2-sha256$…`, `$6$…`, …;
- `sha256:<hex>` and `sha512:<hex>`: a plain digest of the whole key (Unkey, home-made tables).

An old key string is not in apikeys' format, so it names no key id. The record's id is
derived instead, by HMAC-SHA256 under a random secret the store holds (`LOOKUP_SETTING`),
from a *lookup handle*: the old prefix (the part before the first `.`) for keys whose hash is
salted, or the key's SHA-256 or SHA-512 for plain digests. The ids in lists and the store
say nothing about old prefixes, and `KeyManager.verify` looks up every handle a token could
have, whether or not a key exists for the first one, so that the number of lookups does not
tell which old prefixes exist. An unknown token is checked against the manager's decoy, a
hash of apikeys' own scheme: the kind every imported key has once it has been used.

Imports are keyed by (workspace, handle): two workspaces may each hold a key of the same old
prefix (two old systems, or one key string given to two tenants). A handle has
`IMPORT_SLOTS` ids (`lookup_ids`); an import takes the first free one, or finds its own
workspace's, and verification looks up all of them and checks the token against each key
found. The bound keeps the work of one request bounded.

An old system's hash names its own cost (rounds, memory). `cost_refusal` bounds each scheme
a little above its current defaults: an import refuses a hash over the bound, with why, and
verification fails such a stored hash without hashing, since anyone can name its prefix.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from typing import TYPE_CHECKING, Any, Final

from apikeys.errors import ConfigurationError
from apikeys.keys import BASE62, ID_LENGTH

if TYPE_CHECKING:
    from passlib.context import CryptContext

__all__ = [
    "COST_BOUNDS",
    "IMPORTED",
    "IMPORT_SLOTS",
    "INSTALL_HINT",
    "LOOKUP_SETTING",
    "MAX_FOREIGN_LENGTH",
    "MAX_HASH_LENGTH",
    "cost_refusal",
    "digest_handle",
    "foreign_handles",
    "foreign_scheme",
    "is_foreign_token",
    "lookup_id",
    "lookup_ids",
    "needs_prefix",
    "prefix_handle",
    "valid_prefix",
    "verify_foreign",
]

IMPORTED: Final = "imported$"
"""What starts the stored hash of an imported key not yet re-hashed."""
LOOKUP_SETTING: Final = "import_lookup"
"""The store setting holding the secret imported keys' ids are derived with."""
MAX_FOREIGN_LENGTH: Final = 256
"""The longest old key string accepted (djangorestframework-api-key's are 41 characters)."""
INSTALL_HINT: Final = "pip install 'apikeys[import]'"
IMPORT_SLOTS: Final = 4
"""How many workspaces may each hold an imported key of one old prefix (or one digest)."""

_PBKDF2: Final = {"rounds": 2_000_000}  # Django 6.0: 1,200,000
_BCRYPT: Final = {"rounds": 14}  # Django and passlib: 12
_ARGON2: Final = {  # Django: m=102400 KiB, t=2, p=8; argon2-cffi: m=65536, t=3, p=4
    "memory_cost": 131_072,
    "rounds": 4,
    "parallelism": 16,
}
_SHA_CRYPT: Final = {"rounds": 1_000_000}  # passlib: 535,000 and 656,000
COST_BOUNDS: Final[dict[str, dict[str, int]]] = {
    "django_pbkdf2_sha256": _PBKDF2,
    "django_pbkdf2_sha1": _PBKDF2,
    "pbkdf2_sha256": _PBKDF2,
    "pbkdf2_sha512": _PBKDF2,
    "django_bcrypt_sha256": _BCRYPT,
    "django_bcrypt": _BCRYPT,
    "bcrypt": _BCRYPT,
    "bcrypt_sha256": _BCRYPT,
    "django_argon2": _ARGON2,
    "argon2": _ARGON2,
    "sha256_crypt": _SHA_CRYPT,
    "sha512_crypt": _SHA_CRYPT,
}
"""The most each salted scheme's hash may cost, per parameter (passlib's names: `rounds` is
pbkdf2's iterations, bcrypt's log2 cost and argon2's time cost; argon2's `memory_cost` is
in KiB). An imported hash over a bound is refused; stored, it never matches."""

_HEX_DIGESTS: Final = {"sha256:": ("hex_sha256", 64), "sha512:": ("hex_sha512", 128)}
_DRF_SHA512: Final = "sha512$$"
_PREFIX_RE: Final = re.compile(r"[!-~]{1,64}")
# Printable ASCII without spaces: what an old system could have issued as a bearer token.
_TOKEN_RE: Final = re.compile(rf"[!-~]{{8,{MAX_FOREIGN_LENGTH}}}")
# Every hash format read here is printable ASCII without spaces.
MAX_HASH_LENGTH: Final = 1024
"""The longest old hash read: longer text is no hash apikeys can check, refused unread."""
_HASH_RE: Final = re.compile(rf"[!-~]{{1,{MAX_HASH_LENGTH}}}")

# Salted schemes: a hash of one of these only verifies, it cannot find its key.
_SALTED: Final = (
    "django_pbkdf2_sha256",
    "django_pbkdf2_sha1",
    "django_argon2",
    "django_bcrypt_sha256",
    "django_bcrypt",
    "argon2",
    "bcrypt",
    "bcrypt_sha256",
    "pbkdf2_sha256",
    "pbkdf2_sha512",
    "sha256_crypt",
    "sha512_crypt",
)


@functools.cache
def _context() -> CryptContext:
    try:
        from passlib.context import CryptContext
    except ImportError as exc:
        raise ConfigurationError(
            f"imported keys are checked with libpass. Install it with: {INSTALL_HINT}"
        ) from exc
    return CryptContext(schemes=list(_SALTED))


def _hex_handler(name: str) -> Any:
    import passlib.hash

    return getattr(passlib.hash, name)


def foreign_scheme(hashed: str) -> str | None:
    """The name of the scheme of an old system's hash, or None when it is not one apikeys
    can check (passlib's handler name, `sha256`/`sha512` for plain digests).

    Raises `ConfigurationError` naming the extra when libpass is not installed.
    """
    if not isinstance(hashed, str) or len(hashed) > MAX_HASH_LENGTH:
        return None
    for marker, (_handler, length) in _HEX_DIGESTS.items():
        if hashed.startswith(marker):
            digest = hashed[len(marker) :]
            ok = len(digest) == length and re.fullmatch(r"[0-9a-fA-F]+", digest)
            return marker[:-1] if ok else None
    if hashed.startswith(_DRF_SHA512):
        digest = hashed[len(_DRF_SHA512) :]
        ok = len(digest) == 128 and re.fullmatch(r"[0-9a-f]+", digest)
        return "sha512" if ok else None
    scheme = _identify(hashed)
    if scheme is None:
        return None
    handler = _context().handler(scheme)
    if hasattr(handler, "has_backend") and not handler.has_backend():
        raise ConfigurationError(
            f"{scheme} hashes need a package that is not installed (argon2-cffi or bcrypt). "
            f"Install it with: {INSTALL_HINT}"
        )
    return str(scheme) if _parsed(handler, hashed) is not None else None


def _identify(hashed: str) -> str | None:
    """The passlib scheme whose hashes start as `hashed` does, or None."""
    if _HASH_RE.fullmatch(hashed) is None:
        return None
    try:
        scheme = _context().identify(hashed)
    except ValueError:
        return None
    return str(scheme) if scheme else None


def _parsed(handler: Any, hashed: str) -> Any:
    """`hashed` parsed by `handler`, or None when it is not a well-formed hash of its
    scheme, and not only one that starts as such hashes do (what `identify` looks at):
    parsed, not verified, so no key stretching is spent on it."""
    wrapped = getattr(handler, "wrapped", None)
    if wrapped is not None:  # passlib's PrefixWrapper (django_argon2, django_bcrypt)
        hashed = handler.orig_prefix + hashed[len(handler.prefix) :]
        handler = wrapped
    try:
        return handler.from_string(hashed)
    except Exception:
        return None


def cost_refusal(hashed: str) -> str | None:
    """Why the salted hash `hashed` costs too much to check (`COST_BOUNDS`), or None: it is
    within its scheme's bounds, or not a salted hash (then `foreign_scheme` decides).

    Reads the hash's parameters only: no key stretching is spent. Never names the hash.
    """
    if not needs_prefix(hashed) or hashed.startswith(_DRF_SHA512):
        return None
    scheme = _identify(hashed)
    if scheme is None:
        return None
    parsed = _parsed(_context().handler(scheme), hashed)
    if parsed is None:
        return None
    for parameter, bound in COST_BOUNDS.get(scheme, {}).items():
        value = getattr(parsed, parameter, None)
        if not isinstance(value, int) or value > bound:
            return (
                f"its cost is over what apikeys checks: {scheme} {parameter} is at most "
                f"{bound} (see docs/migrating.md)"
            )
    return None


def needs_prefix(hashed: str) -> bool:
    """True when the hash is salted: its key is found by its old prefix, not by a digest."""
    return not hashed.startswith(tuple(_HEX_DIGESTS))


def verify_foreign(token: str, hashed: str) -> bool:
    """Check an old key string against its old system's hash, in constant time (passlib).

    False for a hash that is not a valid one of its scheme (a stored row damaged or edited
    by hand), or that costs more than its scheme's bound (`cost_refusal`, checked before
    any hashing), and for any error while checking it (passlib's, or `OverflowError` from
    a count of rounds past what the platform takes): its key is refused like a wrong
    secret, never an error. Slow for the salted schemes: callers run it in a worker thread.
    """
    try:
        if cost_refusal(hashed) is not None:
            return False
        for marker, (name, _length) in _HEX_DIGESTS.items():
            if hashed.startswith(marker):
                return bool(_hex_handler(name).verify(token, hashed[len(marker) :].lower()))
        if hashed.startswith(_DRF_SHA512):
            return bool(_hex_handler("hex_sha512").verify(token, hashed[len(_DRF_SHA512) :]))
        context = _context()
        return bool(context.identify(hashed)) and bool(context.verify(token, hashed))
    except ConfigurationError:  # libpass itself is missing
        raise
    except RuntimeError as exc:  # passlib's MissingBackendError: argon2-cffi or bcrypt
        raise ConfigurationError(
            f"an imported hash needs a package that is not installed: {INSTALL_HINT}"
        ) from exc
    except Exception:
        return False


def is_foreign_token(token: str, prefix: str) -> bool:
    """True when `token` could be an imported key's old string: printable ASCII without
    spaces, 8 to 256 characters, and not a (damaged) key of apikeys' own `prefix`."""
    return (
        isinstance(token, str)
        and _TOKEN_RE.fullmatch(token) is not None
        and not token.startswith(prefix + "_")
    )


def prefix_handle(prefix: str) -> str:
    """The lookup handle of a key found by its old prefix."""
    return "prefix:" + prefix


def digest_handle(algorithm: str, hex_digest: str) -> str:
    """The lookup handle of a key found by the digest of the whole key."""
    return f"{algorithm}:{hex_digest.lower()}"


def valid_prefix(prefix: str) -> bool:
    """An old prefix apikeys can find keys by: 1 to 64 printable characters, no `.`."""
    return _PREFIX_RE.fullmatch(prefix) is not None and "." not in prefix


def foreign_handles(token: str) -> tuple[str, ...]:
    """Every lookup handle `token` could have, always the same number for tokens of one
    shape: its old prefix (when it has a `.`), its SHA-256 and its SHA-512."""
    encoded = token.encode()
    handles = (
        digest_handle("sha256", hashlib.sha256(encoded).hexdigest()),
        digest_handle("sha512", hashlib.sha512(encoded).hexdigest()),
    )
    old_prefix, dot, _rest = token.partition(".")
    if dot and valid_prefix(old_prefix):
        return (prefix_handle(old_prefix), *handles)
    return handles


def lookup_ids(secret: str, handle: str) -> tuple[str, ...]:
    """The `IMPORT_SLOTS` key ids the imported keys of one lookup handle may have, one per
    workspace holding such a key: the first is `lookup_id(secret, handle)`."""
    return tuple(
        lookup_id(secret, handle if slot == 0 else f"{handle}#{slot}")
        for slot in range(IMPORT_SLOTS)
    )


def lookup_id(secret: str, handle: str) -> str:
    """The key id of the imported key with this lookup handle: 12 base62 characters of
    HMAC-SHA256 under the store's lookup secret."""
    number = int.from_bytes(
        hmac.new(secret.encode(), handle.encode(), hashlib.sha256).digest(), "big"
    )
    characters = []
    for _ in range(ID_LENGTH):
        number, digit = divmod(number, 62)
        characters.append(BASE62[digit])
    return "".join(characters)
