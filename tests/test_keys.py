"""The key format of CONTRACT §1: generation, checksum, parsing and masking.

The checksum is recomputed here independently (a naive divmod loop over CRC32), so these
tests pin the wire format, not the implementation.
"""

from __future__ import annotations

import re
import string
import zlib

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from apikeys.errors import InvalidKeyParameters, MalformedAPIKey
from apikeys.keys import (
    DEFAULT_PREFIX,
    ParsedKey,
    checksum,
    generate_id,
    generate_key,
    key_splitter,
    mask,
    parse_key,
    validate_prefix,
)

ALPHABET = string.digits + string.ascii_uppercase + string.ascii_lowercase
KEY_RE = re.compile(r"^ak_[0-9A-Za-z]{12}_[0-9A-Za-z]{32}[0-9A-Za-z]{6}$")
PREFIX_PATTERN = r"[a-z][a-z0-9_]{0,31}"


def naive_checksum(body: str) -> str:
    """base62 of CRC32 over `body`, zero-padded to 6 digits, one digit at a time."""
    value = zlib.crc32(body.encode("ascii"))
    digits = []
    for _ in range(6):
        value, digit = divmod(value, 62)
        digits.append(ALPHABET[digit])
    assert value == 0  # 62**6 > 2**32: six digits always suffice
    return "".join(reversed(digits))


def build_token(prefix: str, key_id: str, secret: str) -> str:
    body = f"{prefix}_{key_id}_{secret}"
    return body + naive_checksum(body)


# A fixed, valid key, so that every damaged variant below is deterministic.
FIXED_ID = "3xK9pQ2mZ7aB"
FIXED_SECRET = "Vd2hR8sLk4NwQ1e9TfYb6GcJ0uMiPzXa"
FIXED = build_token("ak", FIXED_ID, FIXED_SECRET)
FIXED_CHECKSUM = FIXED[-6:]


def _change(token: str, index: int) -> str:
    """`token` with the character at `index` replaced by a different base62 character."""
    old = token[index]
    new = "A" if old != "A" else "B"
    if old.islower():
        new = "a" if old != "a" else "b"
    return token[:index] + new + token[index + 1 :]


_ID_START = len("ak_")
_SECRET_START = _ID_START + 12 + 1
_CHECKSUM_START = _SECRET_START + 32

DAMAGED = [
    pytest.param(_change(FIXED, 1), id="prefix-char-changed"),
    pytest.param(_change(FIXED, _ID_START + 5), id="id-char-changed"),
    pytest.param(_change(FIXED, _SECRET_START + 10), id="secret-char-changed"),
    pytest.param(_change(FIXED, _CHECKSUM_START + 3), id="checksum-char-changed"),
    pytest.param(FIXED.upper(), id="upper-cased"),
    pytest.param(FIXED.lower(), id="lower-cased"),
    pytest.param(FIXED[:-1], id="truncated-by-one"),
    pytest.param(FIXED[1:], id="first-char-dropped"),
    pytest.param(FIXED + "A", id="padded-by-one"),
    pytest.param(" " + FIXED, id="leading-space"),
    pytest.param(FIXED + " ", id="trailing-space"),
    pytest.param(FIXED + "\n", id="trailing-newline"),
    pytest.param(build_token("sk", FIXED_ID, FIXED_SECRET), id="other-prefix-valid-checksum"),
    pytest.param("", id="empty"),
    pytest.param("ak", id="prefix-only"),
    pytest.param("ak__", id="separators-only"),
    pytest.param(
        build_token("ak", FIXED_ID, FIXED_SECRET[:16] + "_" + FIXED_SECRET[16:]),
        id="extra-segment-in-secret",
    ),
    pytest.param("ak_extra_" + FIXED[_ID_START:], id="extra-segment-after-prefix"),
    pytest.param(FIXED.replace("_", "-"), id="dashes-for-underscores"),
    pytest.param(
        FIXED[: _SECRET_START + 4] + "\u0430" + FIXED[_SECRET_START + 5 :],
        id="cyrillic-lookalike-a",
    ),
    pytest.param(FIXED[:_ID_START] + "\uff13" + FIXED[_ID_START + 1 :], id="fullwidth-digit"),
    pytest.param(
        FIXED[: _SECRET_START + 4] + "\x00" + FIXED[_SECRET_START + 5 :], id="nul-byte-replacing"
    ),
    pytest.param(FIXED + "\x00", id="nul-byte-appended"),
    pytest.param(FIXED * 50, id="very-long-repeated"),
    pytest.param("ak_" + "A" * 12 + "_" + "B" * 100_000, id="very-long-tail"),
    pytest.param(FIXED[:_CHECKSUM_START] + "000000", id="zero-checksum"),
    pytest.param(FIXED[:_CHECKSUM_START], id="checksum-missing"),
    pytest.param(
        build_token("ak", FIXED_ID, FIXED_SECRET)[:_CHECKSUM_START]
        + build_token("ak", FIXED_ID[::-1], FIXED_SECRET)[-6:],
        id="checksum-of-another-key",
    ),
    pytest.param("Bearer " + FIXED, id="scheme-word-included"),
]


# -- generation and format ----------------------------------------------------------------


def test_if_key_generated_then_it_matches_the_contract_format() -> None:
    for _ in range(200):
        token = generate_key().token
        assert KEY_RE.fullmatch(token), token


def test_if_key_generated_then_checksum_is_base62_crc32_of_prefix_id_secret() -> None:
    for _ in range(200):
        parsed = generate_key()
        body = f"{parsed.prefix}_{parsed.id}_{parsed.secret}"
        assert parsed.token == body + naive_checksum(body)
        assert checksum(body) == naive_checksum(body)


@pytest.mark.parametrize(
    "body",
    [
        "",
        "ak_000000000000_00000000000000000000000000000000",
        "ak_3xK9pQ2mZ7aB_Vd2hR8sLk4NwQ1e9TfYb6GcJ0uMiPzXa",
        "a",
        "sk_live_zzzzzzzzzzzz_ZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZ",
    ],
)
def test_if_checksum_computed_then_it_is_six_zero_padded_base62_digits(body: str) -> None:
    value = checksum(body)
    assert len(value) == 6
    assert set(value) <= set(ALPHABET)
    assert value == naive_checksum(body)


def test_if_crc_is_small_then_checksum_is_zero_padded() -> None:
    # crc32(b"") == 0: the checksum is all zeros, not an empty or short string.
    assert zlib.crc32(b"") == 0
    assert checksum("") == "000000"


def test_if_key_generated_then_default_prefix_is_ak() -> None:
    parsed = generate_key()
    assert parsed.prefix == DEFAULT_PREFIX == "ak"
    assert parsed.token.startswith("ak_")
    assert len(parsed.id) == 12
    assert len(parsed.secret) == 32


def test_if_custom_prefix_then_token_starts_with_it_and_parses_back() -> None:
    parsed = generate_key("sk_live")
    assert parsed.token.startswith("sk_live_")
    assert parse_key(parsed.token) == parsed
    assert parse_key(parsed.token, "sk_live") == parsed
    assert parse_key(parsed.token).prefix == "sk_live"


def test_if_prefix_contains_underscores_then_parse_splits_from_the_right() -> None:
    token = build_token("my_app_v2", FIXED_ID, FIXED_SECRET)
    parsed = parse_key(token)
    assert parsed == ParsedKey("my_app_v2", FIXED_ID, FIXED_SECRET)
    assert parse_key(token, "my_app_v2") == parsed


def test_if_prefix_ends_with_underscore_then_key_round_trips() -> None:
    parsed = generate_key("ak_")
    assert parsed.token.startswith("ak__")
    assert parse_key(parsed.token) == parsed


def test_if_key_id_given_then_generate_key_keeps_it() -> None:
    parsed = generate_key(key_id=FIXED_ID)
    assert parsed.id == FIXED_ID
    assert parse_key(parsed.token) == parsed


def test_if_many_keys_generated_then_ids_and_secrets_are_unique() -> None:
    keys = [generate_key() for _ in range(5000)]
    assert len({key.id for key in keys}) == len(keys)
    assert len({key.secret for key in keys}) == len(keys)
    assert len({generate_id() for _ in range(5000)}) == 5000


def test_if_id_generated_then_it_is_twelve_base62_characters() -> None:
    for _ in range(100):
        key_id = generate_id()
        assert re.fullmatch(r"[0-9A-Za-z]{12}", key_id)


# -- prefixes -----------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["ak", "a", "sk_live", "a1", "x_", "a" * 32, "ab_12_cd"])
def test_if_prefix_valid_then_validate_prefix_returns_it(prefix: str) -> None:
    assert validate_prefix(prefix) == prefix


@pytest.mark.parametrize(
    "prefix",
    [
        pytest.param("AK", id="uppercase"),
        pytest.param("aK", id="mixed-case"),
        pytest.param("1ak", id="leading-digit"),
        pytest.param("_ak", id="leading-underscore"),
        pytest.param("", id="empty"),
        pytest.param("a" * 33, id="too-long"),
        pytest.param("a-b", id="dash"),
        pytest.param("a b", id="space"),
        pytest.param("ak\n", id="trailing-newline"),
        pytest.param("\u00e4k", id="non-ascii"),
        pytest.param(None, id="none"),
        pytest.param(b"ak", id="bytes"),
    ],
)
def test_if_prefix_invalid_then_validate_prefix_refuses(prefix: object) -> None:
    with pytest.raises(InvalidKeyParameters):
        validate_prefix(prefix)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix", ["AK", "1ak", "", "a" * 33])
def test_if_prefix_invalid_then_generate_key_refuses(prefix: str) -> None:
    with pytest.raises(InvalidKeyParameters):
        generate_key(prefix)


# -- parsing ------------------------------------------------------------------------------


def test_if_key_valid_then_parse_returns_its_parts() -> None:
    assert parse_key(FIXED) == ParsedKey("ak", FIXED_ID, FIXED_SECRET)
    assert parse_key(FIXED, "ak") == ParsedKey("ak", FIXED_ID, FIXED_SECRET)
    assert parse_key(FIXED).token == FIXED


@pytest.mark.parametrize("token", DAMAGED)
def test_if_key_damaged_then_malformed(token: str) -> None:
    with pytest.raises(MalformedAPIKey):
        parse_key(token, "ak")


@pytest.mark.parametrize(
    "token",
    [param for param in DAMAGED if param.id != "other-prefix-valid-checksum"],
)
def test_if_key_damaged_then_malformed_even_without_expected_prefix(token: str) -> None:
    with pytest.raises(MalformedAPIKey):
        parse_key(token)


def test_if_prefix_expected_then_other_valid_prefix_is_malformed() -> None:
    other = build_token("sk", FIXED_ID, FIXED_SECRET)
    assert parse_key(other).prefix == "sk"  # well-formed on its own
    with pytest.raises(MalformedAPIKey):
        parse_key(other, "ak")


def test_if_prefix_expected_then_prefix_extended_with_underscore_is_malformed() -> None:
    # `ak_x_<id>_<tail>` with a valid checksum is a key of prefix `ak_x`, not of `ak`.
    other = build_token("ak_x", FIXED_ID, FIXED_SECRET)
    assert parse_key(other).prefix == "ak_x"
    with pytest.raises(MalformedAPIKey):
        parse_key(other, "ak")


@pytest.mark.parametrize("token", [None, 42, b"ak_x", ["ak"]])
def test_if_token_is_not_a_str_then_malformed(token: object) -> None:
    with pytest.raises(MalformedAPIKey):
        parse_key(token)  # type: ignore[arg-type]


@pytest.mark.parametrize("token", [None, 42, b"ak_x", ["ak"], *DAMAGED])
def test_if_split_for_a_prefix_then_what_parse_refuses_is_malformed(token: object) -> None:
    split = key_splitter("ak")
    assert split(FIXED) == (FIXED_ID, FIXED_SECRET)
    with pytest.raises(MalformedAPIKey):
        split(token)  # type: ignore[arg-type]


def test_if_checksum_wrong_then_malformed() -> None:
    wrong = "0" if FIXED_CHECKSUM[0] != "0" else "1"
    with pytest.raises(MalformedAPIKey):
        parse_key(FIXED[:-6] + wrong + FIXED[-5:])


# -- never showing the secret -------------------------------------------------------------


def test_if_parsed_key_printed_then_secret_is_hidden() -> None:
    parsed = generate_key()
    for text in (repr(parsed), str(parsed), f"{parsed}", f"{parsed!r}", "%s" % (parsed,)):  # noqa: UP031
        assert parsed.secret not in text
        assert parsed.token not in text
        assert parsed.id in text


def test_if_key_in_a_container_printed_then_secret_is_hidden() -> None:
    parsed = generate_key()
    assert parsed.secret not in repr([parsed])
    assert parsed.secret not in str({"key": parsed})


def test_if_masked_then_form_is_prefix_id_ellipsis() -> None:
    parsed = generate_key()
    assert mask("ak", parsed.id) == f"ak_{parsed.id}_…"
    assert parsed.masked == f"ak_{parsed.id}_…"
    assert parsed.secret not in parsed.masked
    assert mask("sk_live", FIXED_ID) == f"sk_live_{FIXED_ID}_…"


# -- properties ---------------------------------------------------------------------------

prefixes = st.from_regex(PREFIX_PATTERN, fullmatch=True)
base62 = st.sampled_from(ALPHABET)
key_ids = st.text(alphabet=ALPHABET, min_size=12, max_size=12)
secrets_ = st.text(alphabet=ALPHABET, min_size=32, max_size=32)


@st.composite
def valid_tokens(draw: st.DrawFn) -> str:
    return build_token(draw(prefixes), draw(key_ids), draw(secrets_))


@given(prefix=prefixes)
def test_if_any_valid_prefix_then_generated_key_round_trips(prefix: str) -> None:
    parsed = generate_key(prefix)
    assert parse_key(parsed.token) == parsed
    assert parse_key(parsed.token, prefix) == parsed
    assert parsed.token == build_token(prefix, parsed.id, parsed.secret)


@given(prefix=prefixes, key_id=key_ids, secret=secrets_)
def test_if_any_valid_parts_then_built_token_parses_to_them(
    prefix: str, key_id: str, secret: str
) -> None:
    token = build_token(prefix, key_id, secret)
    assert parse_key(token) == ParsedKey(prefix, key_id, secret)


@given(
    token=st.one_of(
        st.text(),
        st.text(alphabet=ALPHABET + "_ "),
        valid_tokens(),
        valid_tokens().map(lambda token: token[:-1]),
        valid_tokens().map(lambda token: "x" + token),
    )
)
@example(token="")
@example(token=FIXED)
@example(token="_" * 50)
def test_if_arbitrary_text_then_parse_refuses_or_returns_the_same_token(token: str) -> None:
    try:
        parsed = parse_key(token)
    except MalformedAPIKey:
        return
    assert parsed.token == token
    assert token == f"{parsed.prefix}_{parsed.id}_{parsed.secret}" + token[-6:]


@given(
    token=valid_tokens(),
    position=st.integers(min_value=0),
    replacement=st.characters(),
)
@example(token=FIXED, position=2, replacement="X")  # the first separator
@example(token=FIXED, position=_SECRET_START - 1, replacement="X")  # the second separator
@example(token=FIXED, position=0, replacement="_")
def test_if_one_character_substituted_anywhere_then_malformed(
    token: str, position: int, replacement: str
) -> None:
    # CRC32 detects every burst of at most 32 bits, so every single-character change of
    # the body is caught; a change in the checksum itself never matches either.
    index = position % len(token)
    if token[index] == replacement:
        replacement = "A" if replacement != "A" else "B"
    damaged = token[:index] + replacement + token[index + 1 :]
    prefix = token.rsplit("_", 2)[0]
    with pytest.raises(MalformedAPIKey):
        parse_key(damaged)
    with pytest.raises(MalformedAPIKey):
        parse_key(damaged, prefix)


@given(
    token=st.one_of(
        st.text(),
        valid_tokens(),
        valid_tokens().map(lambda token: token + "\n"),
        valid_tokens().map(lambda token: token.replace("_", "-", 1)),
    ),
    prefix=st.one_of(prefixes, st.just("ak")),
)
@example(token=FIXED, prefix="ak")
@example(token=FIXED + "\n", prefix="ak")
def test_if_prefix_known_then_parse_agrees_with_parsing_without_it(token: str, prefix: str) -> None:
    # Parsing with a known prefix takes a faster path; it must accept exactly the tokens
    # that the general parser reads as having that prefix.
    try:
        general: ParsedKey | None = parse_key(token)
    except MalformedAPIKey:
        general = None
    expected = general if general is not None and general.prefix == prefix else None
    try:
        known: ParsedKey | None = parse_key(token, prefix)
    except MalformedAPIKey:
        known = None
    assert known == expected
