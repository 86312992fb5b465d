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
    "IMPORTED",
    "INSTALL_HINT",
    "LOOKUP_SETTING",
    "MAX_FOREIGN_LENGTH",
    "MAX_HASH_LENGTH",
    "digest_handle",
    "foreign_handles",
    "foreign_scheme",
    "is_foreign_token",
    "lookup_id",
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
    if _HASH_RE.fullmatch(hashed) is None:
        return None
    context = _context()
    try:
        scheme = context.identify(hashed)
    except ValueError:
        return None
    if not scheme:
        return None
    handler = context.handler(scheme)
    if hasattr(handler, "has_backend") and not handler.has_backend():
        raise ConfigurationError(
            f"{scheme} hashes need a package that is not installed (argon2-cffi or bcrypt). "
            f"Install it with: {INSTALL_HINT}"
        )
    return str(scheme) if _parses(handler, hashed) else None


def _parses(handler: Any, hashed: str) -> bool:
    """Whether `hashed` is a well-formed hash of `handler`'s scheme, and not only one that
    starts as such hashes do (what `identify` looks at): parsed, not verified, so no key
    stretching is spent on it."""
    wrapped = getattr(handler, "wrapped", None)
    if wrapped is not None:  # passlib's PrefixWrapper (django_argon2, django_bcrypt)
        hashed = handler.orig_prefix + hashed[len(handler.prefix) :]
        handler = wrapped
    try:
        handler.from_string(hashed)
    except (TypeError, ValueError):
        return False
    return True


def needs_prefix(hashed: str) -> bool:
    """True when the hash is salted: its key is found by its old prefix, not by a digest."""
    return not hashed.startswith(tuple(_HEX_DIGESTS))


def verify_foreign(token: str, hashed: str) -> bool:
    """Check an old key string against its old system's hash, in constant time (passlib).

    False for a hash that is not a valid one of its scheme (a stored row damaged or edited
    by hand): its key is refused like a wrong secret, never an error.
    Slow for the salted schemes: callers run it in a worker thread.
    """
    try:
        for marker, (name, _length) in _HEX_DIGESTS.items():
            if hashed.startswith(marker):
                return bool(_hex_handler(name).verify(token, hashed[len(marker) :].lower()))
        if hashed.startswith(_DRF_SHA512):
            return bool(_hex_handler("hex_sha512").verify(token, hashed[len(_DRF_SHA512) :]))
        context = _context()
        return bool(context.identify(hashed)) and bool(context.verify(token, hashed))
    except ValueError:
        return False
    except RuntimeError as exc:  # passlib's MissingBackendError: argon2-cffi or bcrypt
        raise ConfigurationError(
            f"an imported hash needs a package that is not installed: {INSTALL_HINT}"
        ) from exc


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
