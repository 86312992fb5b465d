"""Hypothesis strategies for API keys, credentials, scopes and rate limits.

```python
import pytest
from hypothesis import given
from apikeys import parse_key
from apikeys.errors import MalformedAPIKey
from apikeys.testing import strategies as ak

@given(ak.damaged_keys())
def test_damaged_keys_are_refused(token: str) -> None:
    with pytest.raises(MalformedAPIKey):
        parse_key(token)
```

What each strategy promises:

- `keys()`, `parsed_keys()`: keys in the format of the contract (valid checksum).
- `unknown_keys()`: well-formed keys with a random id and secret, so no store knows them.
- `wrong_secrets(token)`: the id of `token` with another secret, checksum valid.
- `damaged_keys(token)`: `token` broken in one way; `parse_key` refuses every one.
- `authorization_headers(token)`: `Authorization` values (bytes, hostile ones included) that
  `APIKeyMiddleware` refuses; none of them presents a usable key.
- `scope_names()`, `scope_sets()`: what `KeyManager.create(scopes=…)` accepts.
- `rate_limits()`: limits in `limits` notation that `parse_rate_limit` accepts.
- `prefixes()`: valid key prefixes.
- `identity_ids()`: ids `KeyManager.create_identity` accepts; `invalid_identity_ids()`:
  text it refuses (`InvalidKeyParameters`).
- `identity_records()`: `IdentityRecord`s as a store keeps them, in every state.
- `labelled_damaged_keys()`, `labelled_authorization_headers()`: the same values as
  `(description, value)` pairs, for failure messages of your own.

Strategies built on a `token` must get the same token on every example: create the key
once (a fixture), not inside the `@given` test.

This module needs the `testing` extra (`pip install "apikeys[testing]"`).
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from typing import NamedTuple

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from apikeys.errors import APIKeyError
from apikeys.keys import (
    BASE62,
    CHECKSUM_LENGTH,
    DEFAULT_PREFIX,
    ID_LENGTH,
    MAX_PREFIX_LENGTH,
    SECRET_LENGTH,
    ParsedKey,
    parse_key,
    validate_prefix,
)
from apikeys.ratelimit import MAX_WINDOW_SECONDS, parse_rate_limit
from apikeys.testing.identity_strategies import (
    identity_ids,
    identity_records,
    invalid_identity_ids,
)

__all__ = [
    "authorization_headers",
    "damaged_keys",
    "identity_ids",
    "identity_records",
    "invalid_identity_ids",
    "keys",
    "labelled_authorization_headers",
    "labelled_damaged_keys",
    "parsed_keys",
    "prefixes",
    "rate_limits",
    "scope_names",
    "scope_sets",
    "unknown_keys",
    "wrong_secrets",
]

Labelled = tuple[str, str]
"""A value and a short description of how it was built (for failure messages)."""

_LOWER = "abcdefghijklmnopqrstuvwxyz"
_PREFIX_CHARS = _LOWER + "0123456789_"
# Characters that are not part of any key, in a key-like position.
_JUNK = "-.+/=:~%"
# Whitespace and invisible characters, ASCII and not. None of them is stripped by RFC 9110.
_WHITESPACE = (
    " ",
    "\t",
    "\n",
    "\r",
    "\x0b",
    "\x0c",
    "\x00",
    "\xa0",
    "\u2003",
    "\u200b",
    "\u3000",
    "\ufeff",
)
# Non-ASCII characters that look like ASCII ones: Cyrillic, Greek, Latin-1 and a few
# confusables. Other characters get their fullwidth form (U+FF01 to U+FF5E).
_LOOKALIKES = {
    "a": "\u0430",
    "c": "\u0441",
    "e": "\u0435",
    "i": "\u0456",
    "j": "\u0458",
    "o": "\u043e",
    "p": "\u0440",
    "s": "\u0455",
    "x": "\u0445",
    "y": "\u0443",
    "A": "\u0391",
    "B": "\u0412",
    "C": "\u0421",
    "E": "\u0415",
    "H": "\u041d",
    "I": "\u0406",
    "K": "\u039a",
    "M": "\u041c",
    "N": "\u039d",
    "O": "\u041e",
    "P": "\u0420",
    "T": "\u0422",
    "X": "\u03a7",
    "Z": "\u0396",
    "0": "\u041e",
    "1": "\u0406",
    "3": "\u0417",
    "_": "\uff3f",
}
_COMMON_PREFIXES = ("ak", "sk", "pk", "myapp", "acme_live", "k", "test_1")
# Prefixes of other vendors' keys, none of them valid here (they hold '-' or capitals).
_FOREIGN_PREFIXES = ("sk-proj", "sk-ant-api03", "AKIA", "xoxb-1", "SG.", "AIza", "GHP")
_SCHEME_CASES = (b"Bearer", b"bearer", b"BEARER", b"bEaReR")
_OTHER_SCHEMES = (
    b"Basic",
    b"Token",
    b"Digest",
    b"ApiKey",
    b"Api-Key",
    b"Key",
    b"Negotiate",
    b"DPoP",
    b"MAC",
    b"OAuth",
    b"AWS4-HMAC-SHA256",
    b"Bearer-Token",
    b"Bearers",
)
_RESOURCES = ("contacts", "campaigns", "invoices", "users", "reports", "billing.v2", "a")
_ACTIONS = ("read", "write", "delete", "trigger", "admin", "list-all")
_RATE_UNITS = ("second", "minute", "hour", "day", "month", "year")
# Seconds of each unit, as limits counts them.
_UNIT_SECONDS = {unit: parse_rate_limit(f"1/{unit}").get_expiry() for unit in _RATE_UNITS}


def _lookalike(char: str) -> str:
    if char in _LOOKALIKES:
        return _LOOKALIKES[char]
    return chr(ord(char) + 0xFEE0) if "!" <= char <= "~" else "\uff1f"


def _check_prefix(prefix: str | None) -> str | None:
    if prefix is None:
        return None
    try:
        return validate_prefix(prefix)
    except APIKeyError as exc:
        raise InvalidArgument(str(exc)) from None


def _parse(token: str, caller: str) -> ParsedKey:
    try:
        return parse_key(token)
    except APIKeyError:
        raise InvalidArgument(f"{caller}() needs a well-formed key") from None


# -- keys ---------------------------------------------------------------------------------


def prefixes() -> st.SearchStrategy[str]:
    """Valid key prefixes: a lowercase letter, then up to 31 lowercase letters, digits, `_`."""
    return st.one_of(
        st.sampled_from(_COMMON_PREFIXES),
        st.builds(
            str.__add__,
            st.sampled_from(_LOWER),
            st.text(_PREFIX_CHARS, max_size=MAX_PREFIX_LENGTH - 1),
        ),
    )


def _to_base62(number: int, length: int) -> str:
    digits = []
    for _ in range(length):
        number, digit = divmod(number, 62)
        digits.append(BASE62[digit])
    return "".join(reversed(digits))


@functools.cache
def _base62(length: int) -> st.SearchStrategy[str]:
    # One integer per part, not one draw per character: several times faster to generate,
    # and it shrinks towards "000…0" all the same.
    return st.integers(0, 62**length - 1).map(functools.partial(_to_base62, length=length))


def parsed_keys(prefix: str | None = None) -> st.SearchStrategy[ParsedKey]:
    """Keys as `ParsedKey(prefix, id, secret)`: `prefix` when given, else any valid prefix."""
    checked = _check_prefix(prefix)
    prefix_strategy = prefixes() if checked is None else st.just(checked)
    return st.builds(ParsedKey, prefix_strategy, _base62(ID_LENGTH), _base62(SECRET_LENGTH))


def keys(prefix: str | None = None) -> st.SearchStrategy[str]:
    """Well-formed keys (`{prefix}_{id}_{secret}{checksum}`), as strings.

    With `prefix` every key has it; with None (the default) any valid prefix appears.
    """
    return parsed_keys(prefix).map(lambda parsed: parsed.token)


def unknown_keys(prefix: str | None = DEFAULT_PREFIX) -> st.SearchStrategy[str]:
    """Well-formed keys with a valid checksum whose id and secret are random.

    No store holds them, so an app answers 401 `invalid_api_key` (or `malformed_api_key`
    when its manager uses another prefix). `prefix` defaults to `ak`; pass your manager's
    prefix, or None for any valid prefix.
    """
    return keys(prefix)


def wrong_secrets(token: str) -> st.SearchStrategy[str]:
    """Keys with the prefix and id of `token`, another secret and a valid checksum.

    Some differ from the real secret in one character only (first, last, any, or its
    case): a comparison that stops early or ignores case lets those through.
    """
    parsed = _parse(token, "wrong_secrets")
    secret = parsed.secret

    def rebuild(new_secret: str) -> str:
        return ParsedKey(parsed.prefix, parsed.id, new_secret).token

    def changed_at(index: int) -> st.SearchStrategy[str]:
        return (
            st.sampled_from(BASE62)
            .filter(lambda char: char != secret[index])
            .map(lambda char: secret[:index] + char + secret[index + 1 :])
        )

    letters = [index for index, char in enumerate(secret) if char.isalpha()]
    options = [
        _base62(SECRET_LENGTH).filter(lambda other: other != secret),
        changed_at(0),
        changed_at(SECRET_LENGTH - 1),
        st.integers(0, SECRET_LENGTH - 1).flatmap(changed_at),
    ]
    if letters:
        options.append(
            st.sampled_from(letters).map(
                lambda index: secret[:index] + secret[index].swapcase() + secret[index + 1 :]
            )
        )
    return st.one_of(options).map(rebuild)


# -- damaged keys -------------------------------------------------------------------------


class _Layout(NamedTuple):
    """Where the parts of a well-formed token are."""

    token: str
    prefix: str
    id_start: int
    secret_start: int
    checksum_start: int

    @property
    def regions(self) -> dict[str, range]:
        return {
            "prefix": range(0, self.id_start - 1),
            "id": range(self.id_start, self.secret_start - 1),
            "secret": range(self.secret_start, self.checksum_start),
            "checksum": range(self.checksum_start, len(self.token)),
        }


def _layout(token: str) -> _Layout:
    parsed = _parse(token, "damaged_keys")
    id_start = len(parsed.prefix) + 1
    secret_start = id_start + ID_LENGTH + 1
    return _Layout(token, parsed.prefix, id_start, secret_start, secret_start + SECRET_LENGTH)


def _replace(token: str, index: int, new: str) -> str:
    return token[:index] + new + token[index + 1 :]


def _insert(token: str, index: int, new: str) -> str:
    return token[:index] + new + token[index:]


Damage = Callable[[st.DrawFn, _Layout], Labelled]

# Every damage below is refused by `parse_key` for certain, not just with high
# probability: a single changed character (or two swapped neighbours) inside
# `{prefix}_{id}_{secret}` always changes its CRC32, a changed checksum never matches,
# and every other damage breaks the length, alphabet or prefix rules.


def _altered(draw: st.DrawFn, layout: _Layout) -> Labelled:
    region = draw(st.sampled_from(("prefix", "id", "secret", "checksum")))
    index = draw(st.sampled_from(layout.regions[region]))
    old = layout.token[index]
    new = draw(st.sampled_from(BASE62 + _JUNK + "_").filter(lambda char: char != old))
    return f"{region} character altered", _replace(layout.token, index, new)


def _separator(draw: st.DrawFn, layout: _Layout) -> Labelled:
    first = draw(st.booleans())
    index = layout.id_start - 1 if first else layout.secret_start - 1
    # Dropping the first separator could read as a longer prefix: only the second may go.
    new = draw(st.sampled_from(("-", ".", ":", " ", "~") if first else ("", "-", ".", ":")))
    which = "first" if first else "second"
    return f"{which} separator replaced by {new!r}", _replace(layout.token, index, new)


def _truncated(draw: st.DrawFn, layout: _Layout) -> Labelled:
    token = layout.token
    if draw(st.booleans()):
        length = draw(st.integers(0, len(token) - 1))
        return f"truncated to {length} characters", token[:length]
    # From the front, only as far as the separator or beyond: a shorter valid-looking
    # prefix would leave the refusal to a checksum collision.
    start = draw(st.integers(layout.id_start - 1, len(token) - 1))
    return f"first {start} characters cut", token[start:]


def _padded(draw: st.DrawFn, layout: _Layout) -> Labelled:
    token = layout.token
    where = draw(st.sampled_from(("end", "start", "id", "secret")))
    if where == "end":
        extra = draw(st.one_of(st.text(BASE62, min_size=1, max_size=16), st.sampled_from(_JUNK)))
        return "padded at the end", token + extra
    if where == "start":
        extra = draw(st.sampled_from("0123456789_-ABCZ" + _JUNK))
        return "padded at the start", extra + token
    char = draw(st.sampled_from(BASE62))
    if where == "id":
        index = draw(st.integers(layout.id_start, layout.secret_start - 1))
    else:
        index = draw(st.integers(layout.secret_start, len(token)))
    return f"character inserted in the {where}", _insert(token, index, char)


def _case_changed(draw: st.DrawFn, layout: _Layout) -> Labelled:
    token = layout.token
    letters = [
        (region, index)
        for region, indexes in layout.regions.items()
        for index in indexes
        if token[index].isalpha()
    ]
    choice = draw(st.sampled_from(("upper", "capitalize", "swapcase", "one letter")))
    if choice == "one letter":
        region, index = draw(st.sampled_from(letters))  # the prefix starts with a letter
        return f"case of a letter in the {region} changed", _replace(
            token, index, token[index].swapcase()
        )
    # Each turns the prefix's first letter into a capital, which no prefix may hold.
    changed = {"upper": token.upper, "capitalize": token.capitalize, "swapcase": token.swapcase}
    return f"case changed ({choice})", changed[choice]()


def _wrong_prefix(draw: st.DrawFn, layout: _Layout) -> Labelled:
    token, prefix = layout.token, layout.prefix
    rest = token[len(prefix) :]
    choice = draw(st.sampled_from(("one character", "foreign", "invalid", "too long")))
    if choice == "one character":
        index = draw(st.integers(0, len(prefix) - 1))
        alphabet = _LOWER if index == 0 else _PREFIX_CHARS
        new = draw(st.sampled_from(alphabet).filter(lambda char: char != prefix[index]))
        return "prefix changed in one character", _replace(prefix, index, new) + rest
    if choice == "foreign":
        return "another vendor's prefix", draw(st.sampled_from(_FOREIGN_PREFIXES)) + rest
    if choice == "invalid":
        options = ("", prefix.upper(), "1" + prefix, prefix + "-", "-" + prefix, prefix + " ")
        return "invalid prefix", draw(st.sampled_from(options)) + rest
    return "prefix too long", "a" * (MAX_PREFIX_LENGTH + 8) + rest


def _whitespace(draw: st.DrawFn, layout: _Layout) -> Labelled:
    token = layout.token
    char = draw(st.sampled_from(_WHITESPACE))
    index = draw(st.integers(0, len(token)))
    if index < len(token) and draw(st.booleans()):
        return f"character replaced by {char!r}", _replace(token, index, char)
    return f"{char!r} inserted", _insert(token, index, char)


def _lookalike_char(draw: st.DrawFn, layout: _Layout) -> Labelled:
    token = layout.token
    index = draw(st.integers(0, len(token) - 1))
    return "non-ASCII lookalike character", _replace(token, index, _lookalike(token[index]))


def _checksum(draw: st.DrawFn, layout: _Layout) -> Labelled:
    token = layout.token
    old = token[layout.checksum_start :]
    new = draw(_base62(CHECKSUM_LENGTH).filter(lambda other: other != old))
    return "checksum replaced", token[: layout.checksum_start] + new


def _doubled(draw: st.DrawFn, layout: _Layout) -> Labelled:
    joiner = draw(st.sampled_from(("", " ", ",", ";", "_")))
    return "key repeated", layout.token + joiner + layout.token


def _transposed(draw: st.DrawFn, layout: _Layout) -> Labelled:
    token = layout.token
    candidates = [
        index
        for region in ("id", "secret")
        for index in layout.regions[region][:-1]
        if token[index] != token[index + 1]
    ]
    if not candidates:  # an id and secret of one repeated character
        return _checksum(draw, layout)
    index = draw(st.sampled_from(candidates))
    swapped = token[:index] + token[index + 1] + token[index] + token[index + 2 :]
    return "two neighbouring characters swapped", swapped


_DAMAGES: tuple[Damage, ...] = (
    _altered,
    _checksum,
    _truncated,
    _padded,
    _case_changed,
    _wrong_prefix,
    _whitespace,
    _lookalike_char,
    _separator,
    _transposed,
    _doubled,
)


@st.composite
def _damage_of(draw: st.DrawFn, token: str) -> Labelled:
    layout = _layout(token)
    damage = draw(st.sampled_from(_DAMAGES))
    return damage(draw, layout)


def labelled_damaged_keys(token: str | None = None) -> st.SearchStrategy[Labelled]:
    """`damaged_keys(token)` as `(description, damaged token)` pairs."""
    if token is not None:
        _layout(token)  # refuse a malformed token now, not at the first draw
        return _damage_of(token)
    return keys().flatmap(_damage_of)


def damaged_keys(token: str | None = None) -> st.SearchStrategy[str]:
    """Keys broken in one way each, every one of which `parse_key` refuses.

    A character of the prefix, id, secret or checksum altered; truncated; padded; case
    changed; another (or an invalid) prefix; whitespace or NUL inserted; a non-ASCII
    lookalike; the checksum replaced; a separator replaced; neighbours swapped; the key
    repeated. Damages `token` when given (a real key of yours makes the best test), else
    random well-formed keys.
    """
    return labelled_damaged_keys(token).map(lambda pair: pair[1])


# -- Authorization headers ----------------------------------------------------------------


def _encode(value: str) -> bytes:
    return value.encode("utf-8")


def _scheme() -> st.SearchStrategy[bytes]:
    return st.sampled_from(_SCHEME_CASES)


def _bad_keys(token: str | None, prefix: str) -> st.SearchStrategy[Labelled]:
    """Keys that must not authenticate, with labels: damaged, unknown, wrong secret."""
    damaged = labelled_damaged_keys(token) if token else keys(prefix).flatmap(_damage_of)
    options = [
        damaged.map(lambda pair: ("damaged key: " + pair[0], pair[1])),
        unknown_keys(prefix).map(lambda key: ("unknown key", key)),
    ]
    if token is not None:
        options.append(wrong_secrets(token).map(lambda key: ("wrong secret", key)))
    return st.one_of(options)


Template = tuple[str, Callable[[bytes], bytes]]


def _shaped(label: str, *shapes: bytes) -> list[Template]:
    """Templates that put the key where `{}` stands in each shape."""
    return [(label, functools.partial(_fill, shape)) for shape in shapes]


def _fill(shape: bytes, key: bytes) -> bytes:
    return shape.replace(b"{}", key)


def _fullwidth(key: bytes) -> bytes:
    return _encode("".join(_lookalike(char) for char in key.decode("ascii")))


def _utf16(key: bytes) -> bytes:
    return key.decode("ascii").encode("utf-16")


def _bearer(transform: Callable[[bytes], bytes], key: bytes) -> bytes:
    return b"Bearer " + transform(key)


def _basic(transform: Callable[[bytes], bytes], key: bytes) -> bytes:
    return b"Basic " + base64.b64encode(transform(key))


# Ways of sending a key (possibly a real one) that are not `Bearer <key>`: each is refused
# whatever the key, because the bytes around it are wrong.
_TEMPLATES: list[Template] = [
    *_shaped("other scheme", *(scheme + b" {}" for scheme in _OTHER_SCHEMES)),
    ("Basic credentials", functools.partial(_basic, lambda key: key + b":")),
    ("Basic credentials", functools.partial(_basic, lambda key: b"api:" + key)),
    ("Basic credentials", functools.partial(_basic, lambda key: key)),
    *_shaped(
        "repeated scheme",
        b"Bearer Bearer {}",
        b"Bearer bearer {}",
        b"Bearer {} Bearer",
        b"{} Bearer",
    ),
    *_shaped("missing space", *(scheme + b"{}" for scheme in _SCHEME_CASES)),
    *_shaped(
        "whitespace instead of one space",
        b"Bearer  {}",
        b"Bearer\t{}",
        b"Bearer \t{}",
        b"Bearer\xa0{}",
        b"Bearer\r\n {}",
        b"Bearer\x00{}",
    ),
    *_shaped(
        "separator after the scheme",
        b"Bearer:{}",
        b"Bearer={}",
        b"Bearer,{}",
        b"Bearer: {}",
        b"Bearer= {}",
        b"Bearer/{}",
    ),
    *_shaped(
        "key quoted or without a scheme",
        b'Bearer "{}"',
        b"Bearer '{}'",
        b"Bearer <{}>",
        b"Bearer ({})",
        b"Bearer [{}]",
        b"{}",
    ),
    *_shaped(
        "trailing data",
        b"Bearer {} {}",
        b"Bearer {},{}",
        b"Bearer {}, Bearer {}",
        b"Bearer {};",
        b"Bearer {},",
        b"Bearer {}\x00",
        b"Bearer {}\r\nX-Injected: 1",
        b"Bearer {}\n",
        b"Bearer {}\x0b",
    ),
    ("key encoded", functools.partial(_bearer, base64.b64encode)),
    ("key encoded", functools.partial(_bearer, lambda key: key.replace(b"_", b"%5F"))),
    ("key encoded", functools.partial(_bearer, _utf16)),
    ("key encoded", functools.partial(_bearer, _fullwidth)),
    ("key encoded", functools.partial(_bearer, lambda key: key[::-1])),
    *_shaped(
        "lookalike scheme",
        "B\u0435arer {}".encode(),  # Cyrillic e
        "\u0412earer {}".encode(),  # Cyrillic Ve
        "\uff22earer {}".encode(),  # fullwidth B
        "Bearer".encode("utf-16") + b" {}",
    ),
]


@st.composite
def _with_byte(
    draw: st.DrawFn, key: st.SearchStrategy[bytes], byte: st.SearchStrategy[int]
) -> bytes:
    value = draw(key)
    index = draw(st.integers(0, len(value)))
    return b"Bearer " + value[:index] + bytes([draw(byte)]) + value[index:]


def _hostile(key: st.SearchStrategy[bytes]) -> st.SearchStrategy[tuple[str, bytes]]:
    """Values around random keys: bytes no well-behaved client sends."""
    return st.one_of(
        st.just(("empty value", b"")),
        st.sampled_from(
            (b"Bearer", b"Bearer ", b"bearer", b"BEARER  ", b"Bearer\t", b"Bearer \x00", b" ")
        ).map(lambda value: ("scheme only", value)),
        st.binary(max_size=300).map(lambda value: ("random bytes", value)),
        st.text(max_size=100).map(lambda text: ("random text", _encode(text))),
        _with_byte(key, st.integers(0x80, 0xFF)).map(lambda value: ("latin-1 byte", value)),
        _with_byte(key, st.sampled_from((0, 9, 10, 13, 27, 127))).map(
            lambda value: ("control byte", value)
        ),
        st.integers(250, 100_000).map(lambda size: ("huge value", b"Bearer " + b"A" * size)),
        st.tuples(key, st.integers(200, 20_000)).map(
            lambda pair: ("huge value", b"Bearer " + pair[0] + b" " * pair[1])
        ),
    )


@st.composite
def _labelled_headers(
    draw: st.DrawFn,
    bad: st.SearchStrategy[tuple[str, bytes]],
    presented: st.SearchStrategy[tuple[str, bytes]],
    hostile: st.SearchStrategy[tuple[str, bytes]],
) -> tuple[str, bytes]:
    # One in two: the most realistic, a well-formed header carrying a key that must fail.
    kind = draw(st.integers(0, 3))
    return draw(bad if kind < 2 else presented if kind == 2 else hostile)


def labelled_authorization_headers(
    token: str | None = None, *, prefix: str | None = None
) -> st.SearchStrategy[tuple[str, bytes]]:
    """`authorization_headers(token, prefix=prefix)` as `(description, value)` pairs."""
    if token is not None:
        prefix = _parse(token, "authorization_headers").prefix
    prefix = _check_prefix(prefix) or DEFAULT_PREFIX
    random_keys = unknown_keys(prefix).map(_encode)
    bad = st.tuples(_scheme(), _bad_keys(token, prefix)).map(
        lambda pair: (pair[1][0], pair[0] + b" " + _encode(pair[1][1]))
    )
    key = st.just(_encode(token)) if token is not None else random_keys
    presented = st.tuples(st.sampled_from(_TEMPLATES), key).map(
        lambda pair: (pair[0][0], pair[0][1](pair[1]))
    )
    return _labelled_headers(bad, presented, _hostile(random_keys))


def authorization_headers(
    token: str | None = None, *, prefix: str | None = None
) -> st.SearchStrategy[bytes]:
    """`Authorization` header values, as raw bytes, that must never authenticate.

    Well-formed `Bearer` headers with a damaged, unknown or wrong-secret key; other schemes
    (`Basic`, `Token`, `DPoP`, …); `Bearer` repeated, without its space, with two spaces, a
    tab, NBSP or CR LF; quoted, encoded or fullwidth keys; trailing data; NUL, control and
    latin-1 high bytes; values over 100 KB; random bytes and text; lookalike schemes.

    With `token` (a real, usable key) the variants are built around it, so an app that
    strips, splits or decodes too leniently lets one through. `APIKeyMiddleware` answers
    401 to every value. Random keys get `prefix` (default `ak`, or the prefix of `token`).
    Leading and trailing spaces around a whole value are left out:
    HTTP servers strip them (RFC 9110, section 5.5), so they are not a client's mistake.
    httpx refuses to send some of these bytes: drive the ASGI app directly (see
    `apikeys.testing.assert_rejects_bad_credentials`).
    """
    return labelled_authorization_headers(token, prefix=prefix).map(lambda pair: pair[1])


# -- scopes and rate limits ---------------------------------------------------------------


def _scope_part() -> st.SearchStrategy[str]:
    return st.from_regex(r"[a-z][a-z0-9_.\-]{0,63}", fullmatch=True)


def scope_names(*, wildcards: bool = True) -> st.SearchStrategy[str]:
    """Valid scopes: `resource:action`, and `resource:*` grants unless `wildcards=False`."""
    resource = st.one_of(st.sampled_from(_RESOURCES), _scope_part())
    action = st.one_of(st.sampled_from(_ACTIONS), _scope_part())
    if wildcards:
        action = st.one_of(action, st.just("*"))
    return st.builds(lambda res, act: f"{res}:{act}", resource, action)


def scope_sets(
    *, min_size: int = 1, max_size: int = 5, wildcards: bool = True
) -> st.SearchStrategy[list[str]]:
    """Lists of distinct valid scopes, as `KeyManager.create(scopes=…)` takes them."""
    return st.lists(
        scope_names(wildcards=wildcards), min_size=min_size, max_size=max_size, unique=True
    )


@st.composite
def _rate_limit(draw: st.DrawFn) -> str:
    amount = draw(st.integers(1, 10_000))
    unit = draw(st.sampled_from(_RATE_UNITS))
    multiple = draw(st.one_of(st.none(), st.integers(1, 60)))
    separator = draw(st.sampled_from(("/", " per ", " / ")))
    if multiple is None:
        return f"{amount}{separator}{unit}"
    # parse_rate_limit refuses windows over a year (what every limits storage can hold).
    multiple = min(multiple, MAX_WINDOW_SECONDS // _UNIT_SECONDS[unit])
    return f"{amount}{separator}{multiple} {unit}s"


def rate_limits() -> st.SearchStrategy[str]:
    """Rate limits in `limits` notation that `parse_rate_limit` accepts.

    `3/second`, `10 per minute`, `100 per 2 minutes`, `5 / 3 hours`: one limit each, an
    amount of 1 to 10 000, windows from a second to a year.
    """
    return _rate_limit()
