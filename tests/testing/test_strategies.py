"""apikeys.testing.strategies: every example keeps the promise its docstring makes."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from apikeys import AuthenticationError, InvalidAPIKey, KeyManager
from apikeys.errors import MalformedAPIKey
from apikeys.keys import ParsedKey, generate_key, parse_key
from apikeys.middleware import bearer_token
from apikeys.ratelimit import parse_rate_limit
from apikeys.scopes import validate_scope, validate_scopes
from apikeys.testing import KeyFactory, in_memory_manager, strategies
from apikeys.testing.factory import close_manager, run_sync
from apikeys.testing.strategies import (
    _DAMAGES,
    _layout,
    authorization_headers,
    damaged_keys,
    keys,
    labelled_authorization_headers,
    labelled_damaged_keys,
    parsed_keys,
    prefixes,
    rate_limits,
    scope_names,
    scope_sets,
    unknown_keys,
    wrong_secrets,
)

FAST = settings(max_examples=100, deadline=None, database=None)
T = TypeVar("T")


def sample(strategy: st.SearchStrategy[T], count: int = 600) -> list[T]:
    """`count` examples of `strategy`, the same on every run (no shrinking, no database)."""
    examples: list[T] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: T) -> None:
        examples.append(example)

    collect()
    return examples


@functools.cache
def header_sample() -> list[bytes]:
    return sample(authorization_headers(FIXED_KEYS[0]))


@functools.cache
def damage_labels() -> set[str]:
    return {label for label, _ in sample(labelled_damaged_keys(FIXED_KEYS[0]))}


# Fixed keys, some of them degenerate (no letters, one repeated character), some with a
# prefix holding '_': the damages must hold for every shape of key.
FIXED_KEYS = [
    generate_key().token,
    generate_key("my_app_2").token,
    generate_key("a_").token,
    ParsedKey("ak", "0" * 12, "0" * 32).token,
    ParsedKey("x", "A" * 12, "9" * 32).token,
    ParsedKey("a" * 32, "abcdefghijkl", "Z" * 32).token,
]
# Ids that name each key's shape (the drawn ones differ from run to run, and from one
# worker of a parallel run to another).
FIXED_KEY_IDS = ["drawn", "drawn-my_app_2", "drawn-a_", "zeros", "one-letter", "long-prefix"]


def refused(token: str, prefix: str | None = None) -> bool:
    try:
        parse_key(token, prefix)
    except MalformedAPIKey:
        return True
    return False


@pytest.fixture(scope="module")
def manager_and_key() -> Iterator[tuple[KeyManager, str]]:
    """One manager holding one usable key, shared by the property tests of this module."""
    manager = in_memory_manager()
    try:
        created = KeyFactory(manager).sync(scopes=["contacts:read"])
        yield manager, created.key
    finally:
        close_manager(manager)


class TestKeys:
    @FAST
    @given(token=keys())
    def test_keys_are_well_formed(self, token: str) -> None:
        parsed = parse_key(token)
        assert parsed.token == token

    @FAST
    @given(token=keys("my_app"))
    def test_keys_with_a_prefix_have_it(self, token: str) -> None:
        assert parse_key(token, "my_app").prefix == "my_app"

    @FAST
    @given(parsed=parsed_keys())
    def test_parsed_keys_round_trip(self, parsed: ParsedKey) -> None:
        assert parse_key(parsed.token) == parsed

    @FAST
    @given(prefix=prefixes())
    def test_prefixes_are_valid(self, prefix: str) -> None:
        parse_key(generate_key(prefix).token, prefix)

    def test_any_prefix_appears_when_none_is_given(self) -> None:
        assert any(not token.startswith("ak_") for token in sample(keys(), 200))

    @pytest.mark.parametrize("prefix", ["", "Ak", "1a", "a-b", "a" * 33])
    def test_invalid_prefix_is_refused_up_front(self, prefix: str) -> None:
        with pytest.raises(InvalidArgument):
            keys(prefix).validate()

    @FAST
    @given(token=unknown_keys())
    def test_unknown_keys_are_well_formed_and_unknown(
        self, token: str, manager_and_key: tuple[KeyManager, str]
    ) -> None:
        manager, _ = manager_and_key
        assert parse_key(token, "ak")
        with pytest.raises(InvalidAPIKey):
            run_sync(manager.verify(token))

    @FAST
    @given(data=st.data())
    def test_wrong_secrets_keep_the_id_and_fail(
        self, data: Any, manager_and_key: tuple[KeyManager, str]
    ) -> None:
        manager, key = manager_and_key
        wrong = data.draw(wrong_secrets(key))
        parsed, real = parse_key(wrong), parse_key(key)
        assert (parsed.prefix, parsed.id) == (real.prefix, real.id)
        assert parsed.secret != real.secret
        with pytest.raises(InvalidAPIKey):
            run_sync(manager.verify(wrong))

    def test_wrong_secrets_include_one_character_changes(self) -> None:
        key = FIXED_KEYS[0]
        secret = parse_key(key).secret

        def one_off(token: str) -> bool:
            other = parse_key(token).secret
            return sum(a != b for a, b in zip(secret, other, strict=True)) == 1

        assert any(one_off(token) for token in sample(wrong_secrets(key), 200))

    @pytest.mark.parametrize("strategy", [wrong_secrets, damaged_keys])
    def test_malformed_token_is_refused_up_front(self, strategy: Callable[..., Any]) -> None:
        with pytest.raises(InvalidArgument):
            strategy("ak_not_a_key").validate()


class TestDamagedKeys:
    @settings(max_examples=200, deadline=None, database=None)
    @given(token=damaged_keys())
    def test_every_damaged_key_is_refused(self, token: str) -> None:
        assert refused(token)

    @pytest.mark.parametrize("key", FIXED_KEYS, ids=FIXED_KEY_IDS)
    @settings(max_examples=150, deadline=None, database=None)
    @given(data=st.data())
    def test_every_damage_of_a_given_key_is_refused(self, key: str, data: Any) -> None:
        label, token = data.draw(labelled_damaged_keys(key))
        assert token != key
        prefix = parse_key(key).prefix
        assert refused(token), label
        assert refused(token, prefix), label

    @pytest.mark.parametrize("damage", _DAMAGES, ids=lambda damage: damage.__name__)
    @settings(max_examples=40, deadline=None, database=None)
    @given(data=st.data())
    def test_each_kind_of_damage_is_refused_on_every_key_shape(
        self, damage: Any, data: Any
    ) -> None:
        key = data.draw(st.sampled_from(FIXED_KEYS))
        layout = _layout(key)
        label, token = data.draw(st.composite(lambda draw: damage(draw, layout))())
        assert refused(token), label
        assert refused(token, layout.prefix), label

    @pytest.mark.parametrize(
        ("what", "condition"),
        [
            ("altered", lambda label: "character altered" in label),
            ("truncated", lambda label: label.startswith(("truncated", "first"))),
            ("padded", lambda label: "padded" in label or "inserted in" in label),
            ("case changed", lambda label: "case" in label),
            ("wrong prefix", lambda label: "prefix" in label),
            ("whitespace", lambda label: "'\\t'" in label or "'\\x00'" in label),
            ("lookalike", lambda label: "lookalike" in label),
            ("checksum", lambda label: label == "checksum replaced"),
        ],
    )
    def test_every_kind_of_damage_appears(
        self, what: str, condition: Callable[[str], bool]
    ) -> None:
        assert any(condition(label) for label in damage_labels())


class TestAuthorizationHeaders:
    @settings(max_examples=200, deadline=None, database=None)
    @given(data=st.data())
    def test_no_header_authenticates(
        self, data: Any, manager_and_key: tuple[KeyManager, str]
    ) -> None:
        manager, key = manager_and_key
        token = data.draw(st.one_of(st.none(), st.just(key)))
        value = data.draw(authorization_headers(token))
        assert isinstance(value, bytes)
        with pytest.raises(AuthenticationError):
            run_sync(manager.verify(bearer_token([value]), record_usage=False))

    @pytest.mark.parametrize(
        ("what", "condition"),
        [
            ("NUL", lambda value: b"\x00" in value),
            ("CR LF", lambda value: b"\r" in value or b"\n" in value),
            ("latin-1", lambda value: any(byte >= 0x80 for byte in value)),
            ("huge", lambda value: len(value) > 10_000),
            ("other scheme", lambda value: value.startswith((b"Basic ", b"Token "))),
            ("repeated Bearer", lambda value: value.lower().count(b"bearer") >= 2),
            ("missing space", lambda value: re.match(rb"(?i)bearer[a-z]{2}_", value)),
            ("tab", lambda value: value.startswith(b"Bearer\t")),
            ("well-formed", lambda value: re.fullmatch(rb"(?i)bearer ak_\w{12}_\w{38}", value)),
        ],
    )
    def test_every_kind_of_hostile_value_appears(
        self, what: str, condition: Callable[[bytes], object]
    ) -> None:
        assert any(condition(value) for value in header_sample())

    def test_a_custom_prefix_reaches_random_keys(self) -> None:
        pairs = sample(labelled_authorization_headers(prefix="my_app"), 300)
        assert any(label == "unknown key" and b" my_app_" in value for label, value in pairs)


class TestScopesAndRateLimits:
    @FAST
    @given(scope=scope_names())
    def test_scope_names_are_valid(self, scope: str) -> None:
        assert validate_scope(scope) == scope

    @FAST
    @given(scope=scope_names(wildcards=False))
    def test_without_wildcards_there_is_no_star(self, scope: str) -> None:
        assert not scope.endswith(":*")

    def test_wildcards_appear(self) -> None:
        assert any(scope.endswith(":*") for scope in sample(scope_names(), 200))

    @settings(max_examples=40, deadline=None, database=None)
    @given(scopes=scope_sets())
    def test_scope_sets_create_keys(self, scopes: list[str]) -> None:
        assert len(set(scopes)) == len(scopes) >= 1
        assert validate_scopes(scopes) == tuple(sorted(scopes))
        manager = in_memory_manager()
        try:
            created = KeyFactory(manager).sync(scopes=scopes)
        finally:
            close_manager(manager)
        assert created.record.scopes == tuple(sorted(scopes))

    @settings(max_examples=200, deadline=None, database=None)
    @given(limit=rate_limits())
    def test_rate_limits_parse(self, limit: str) -> None:
        item = parse_rate_limit(limit)
        assert item.amount >= 1

    @pytest.mark.parametrize("form", [r"^\d+/\w+$", r"^\d+ per \w+$", r"^\d+ per \d+ \w+s$"])
    def test_rate_limits_come_in_every_notation(self, form: str) -> None:
        assert any(re.match(form, limit) for limit in sample(rate_limits(), 300))


def test_every_public_strategy_is_exported_and_documented() -> None:
    for name in strategies.__all__:
        function = getattr(strategies, name)
        assert function.__doc__, name
        strategy = function(FIXED_KEYS[0]) if name == "wrong_secrets" else function()
        assert isinstance(strategy, st.SearchStrategy), name
