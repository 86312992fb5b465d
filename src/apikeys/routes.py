"""Route tables: which scopes a request needs, and what it costs in credits.

Both map `"METHOD /path/{param}"` rules, matched the same way: the most specific rule wins,
whatever the order the rules were given in. Built once, when the middleware (or an
integration) is built; a rule that cannot be understood raises `ConfigurationError` then.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

from apikeys.errors import ConfigurationError
from apikeys.scopes import validate_scope

__all__ = ["CostTable", "ScopeTable"]

_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT", "*"}
)
# {name} or {name:converter}; split() yields literal, name, converter, literal, ...
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z_][A-Za-z0-9_]*))?\}")


class ScopeTable:
    """Maps `"METHOD /path/{param}"` rules to the scopes a request needs.

    A rule's value is one scope or a non-empty list of scopes (all required). `*` as the
    method matches every method; `HEAD` falls back to the `GET` rule. Methods match whatever
    their case (`get` needs what `GET` needs). `{name}` matches one path segment; Starlette's
    converters are understood: `{name:str}`, `{name:int}`, `{name:float}`, `{name:uuid}`,
    `{name:path}` (the rest of the path) and any converter registered with Starlette.

    When several rules match, the most specific wins, whatever the order they were given in:
    a rule without parameters first; then, segment by segment from the left, a literal
    segment beats a typed parameter (`int`, `uuid`, …), which beats a plain one, which beats
    `{name:path}`; then a named method beats `*`. `required()` answers None for a request
    no rule covers.
    """

    def __init__(self, rules: Mapping[str, str | Sequence[str]] | None = None) -> None:
        self._static: dict[tuple[str, str], tuple[str, ...]] = {}
        dynamic: list[tuple[tuple[object, ...], str, re.Pattern[str], tuple[str, ...]]] = []
        for rule, required in (rules or {}).items():
            method, path = self._parse_rule(rule)
            scopes = self._parse_scopes(rule, required)
            if "{" not in path and "}" not in path:
                self._static[method, path] = scopes
                continue
            pattern, ranks = self._compile(rule, path)
            # Most specific first: literal segments, then typed, plain and path parameters.
            order = (tuple(-rank for rank in ranks), method == "*", rule)
            dynamic.append((order, method, pattern, scopes))
        dynamic.sort(key=lambda entry: entry[0])
        self._dynamic = [(method, pattern, scopes) for _, method, pattern, scopes in dynamic]

    @staticmethod
    def _parse_rule(rule: str) -> tuple[str, str]:
        method, _, path = rule.strip().partition(" ")
        method, path = method.upper(), path.strip()
        if method not in _METHODS or not path.startswith("/") or " " in path:
            raise ConfigurationError(
                f"invalid scope rule {rule!r}: write it as 'GET /api/v1/contacts/{{id}}'"
            )
        return method, path

    @staticmethod
    def _parse_scopes(rule: str, required: str | Sequence[str]) -> tuple[str, ...]:
        scopes = (required,) if isinstance(required, str) else tuple(required)
        if not scopes:
            raise ConfigurationError(
                f"scope rule {rule!r} names no scope: a rule must require at least one "
                "(leave the route out of `protect` to make it public)"
            )
        for scope in scopes:
            validate_scope(scope)
        return scopes

    @staticmethod
    def _compile(rule: str, path: str) -> tuple[re.Pattern[str], list[int]]:
        pattern, ranks = "", []
        segments = path[1:].split("/")
        for position, segment in enumerate(segments):
            pattern += "/"
            parts = _PARAM.split(segment)
            # parts: literal, name, converter, literal, name, converter, ..., literal
            literal = "".join(parts[0::3])
            if "{" in literal or "}" in literal:
                raise ConfigurationError(f"invalid scope rule {rule!r}: unbalanced braces")
            if len(parts) == 1:
                pattern += re.escape(segment)
                ranks.append(_RANK_LITERAL)
                continue
            rank = _RANK_LITERAL
            for index in range(1, len(parts), 3):
                pattern += re.escape(parts[index - 1])
                converter = parts[index + 1] or "str"
                regex = _converter_regex(rule, converter)
                if converter == "path":
                    if position != len(segments) - 1 or parts[index + 2]:
                        raise ConfigurationError(
                            f"invalid scope rule {rule!r}: {{name:path}} must end the path"
                        )
                    rank = min(rank, _RANK_PATH)
                else:
                    rank = min(rank, _RANK_PLAIN if converter == "str" else _RANK_TYPED)
                pattern += f"(?:{regex})"
            pattern += re.escape(parts[-1])
            # A segment that mixes text and a parameter ("v{n:int}") ranks above a bare one.
            ranks.append(rank + (1 if literal and rank != _RANK_PATH else 0))
        return re.compile(pattern), ranks

    def required(self, method: str, path: str) -> tuple[str, ...] | None:
        """The scopes `method path` needs; None when no rule covers it.

        `method` is matched in upper case (ASCII only: a method with other characters matches
        only `*` rules).
        """
        if not method.isupper():
            method = method.upper() if method.isascii() else "*"
        static = self._static
        found = static.get((method, path))
        if found is None and method == "HEAD":
            found = static.get(("GET", path))
        if found is None:
            found = static.get(("*", path))
        if found is not None:
            return found
        for rule_method, pattern, scopes in self._dynamic:
            method_matches = rule_method in (method, "*") or (
                method == "HEAD" and rule_method == "GET"
            )
            if method_matches and pattern.fullmatch(path):
                return scopes
        return None


_RANK_PATH, _RANK_PLAIN, _RANK_TYPED, _RANK_LITERAL = 0, 2, 4, 6


def _converter_regex(rule: str, converter: str) -> str:
    from starlette.convertors import CONVERTOR_TYPES

    found = CONVERTOR_TYPES.get(converter)
    if found is None:
        known = ", ".join(sorted(CONVERTOR_TYPES))
        raise ConfigurationError(
            f"invalid scope rule {rule!r}: unknown converter {converter!r} (known: {known})"
        )
    return str(found.regex)


class CostTable(ScopeTable):
    """Maps `"METHOD /path/{param}"` rules to the credits a request costs (1 where no rule
    matches), with `ScopeTable`'s matching: `{"POST /api/v1/campaigns/{id}/trigger": 5}`."""

    @staticmethod
    def _parse_scopes(rule: str, required: Any) -> tuple[str, ...]:
        if isinstance(required, bool) or not isinstance(required, int) or required < 1:
            raise ConfigurationError(
                f"cost rule {rule!r}: a cost is a whole number of credits, at least 1"
            )
        return (str(required),)

    def __init__(self, rules: Mapping[str, int] | None = None) -> None:
        super().__init__(cast("Mapping[str, str]", rules))

    def cost(self, method: str, path: str) -> int:
        """What a request to `method path` costs: its rule's credits, else 1."""
        found = self.required(method, path)
        return int(found[0]) if found else 1
