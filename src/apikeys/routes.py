"""Route tables: which scopes a request needs, and what it costs in credits.

Both map `"METHOD /path/{param}"` rules, matched the same way: the most specific rule wins,
whatever the order the rules were given in. Built once, when the middleware (or an
integration) is built; a rule that cannot be understood raises `ConfigurationError` then,
and so does a rule in another framework's syntax (Django's or Flask's `<int:pk>`, a regular
expression's `(?P<pk>…)`), with the spelling to use instead (`{pk:int}`).

`check_routes(app, scopes=…, costs=…)` holds the rules against the routes of a Starlette or
FastAPI app, at start: a rule that matches no route, or matches one only once a trailing
slash is added or taken away, is logged and warned about (`RouteRuleWarning`), once per
rule; nothing is refused, since an app may add routes later or serve some outside its router.

`serves_cors(app)` says whether Starlette's `CORSMiddleware` runs inside `app`, and
`is_preflight(scope)` whether a request is a CORS preflight: such a request, sent without a
key to an app that serves CORS, may pass without one, since `CORSMiddleware` answers every
preflight itself and never runs an endpoint for it.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

from apikeys.errors import ConfigurationError
from apikeys.scopes import validate_scope

__all__ = [
    "CostTable",
    "RouteRuleWarning",
    "ScopeTable",
    "check_routes",
    "is_preflight",
    "preflight_answerer",
    "routed_as",
    "routes_of",
    "serves_cors",
]

logger = logging.getLogger("apikeys")

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
        if not isinstance(rule, str):
            raise ConfigurationError(f"invalid scope rule {rule!r}: a rule is a string")
        method, _, path = rule.strip().partition(" ")
        method, path = method.upper(), path.strip()
        if method not in _METHODS or not path.startswith("/") or " " in path:
            raise ConfigurationError(
                f"invalid scope rule {rule!r}: write it as 'GET /api/v1/contacts/{{id}}'"
            )
        if "<" in path or ">" in path:
            # `<` and `>` are never literal in a request path (they arrive percent-encoded).
            raise ConfigurationError(
                f"invalid scope rule {rule!r}: parameters are written {{name}} or "
                f"{{name:converter}} (Starlette's syntax), not Django's or Flask's <converter:"
                f"name>; write it as '{method} {_our_spelling(path)}'"
            )
        return method, path

    @staticmethod
    def _parse_scopes(rule: str, required: str | Sequence[str]) -> tuple[str, ...]:
        if isinstance(required, str):
            scopes: tuple[str, ...] = (required,)
        elif isinstance(required, Sequence) and all(isinstance(s, str) for s in required):
            scopes = tuple(required)
        else:
            raise ConfigurationError(
                f"scope rule {rule!r} takes a scope or a list of scopes, not {required!r:.50}"
            )
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
        only `*` rules). `path` is matched as the application's router sees it
        (`routed_as`): `/admin` followed by a line break needs what `/admin` needs.
        """
        if path[-1:] == "\n":
            path = routed_as(path)
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


def routed_as(path: str) -> str:
    """`path` as a router that matches `^…$` patterns sees it (Starlette's, so FastAPI's and
    every app mounted in one): Python's `$` also matches before a final line break, so
    `/admin` followed by `%0A` is routed to `/admin`. Rules are matched on this path, so
    that a request never reaches a route under rules other than that route's."""
    return path[:-1] if path[-1:] == "\n" else path


# Django's and Flask's converters, in Starlette's spelling (None: a plain {name}).
_FOREIGN_CONVERTERS = {"int": "int", "float": "float", "uuid": "uuid", "path": "path"}
_FOREIGN_PARAM = re.compile(r"<(?:([A-Za-z_]\w*):)?([A-Za-z_]\w*)>")
_REGEX_GROUP = re.compile(r"\(\?P<([A-Za-z_]\w*)>[^)]*\)")


def _our_spelling(path: str) -> str:
    """`path` with `<int:pk>` and `(?P<pk>…)` parameters written as `{pk:int}` and `{pk}`."""

    def converted(match: re.Match[str]) -> str:
        converter = _FOREIGN_CONVERTERS.get(match.group(1) or "")
        return f"{{{match.group(2)}:{converter}}}" if converter else f"{{{match.group(2)}}}"

    path = _REGEX_GROUP.sub(lambda match: f"{{{match.group(1)}}}", path)
    return _FOREIGN_PARAM.sub(converted, path).replace("^", "").replace("$", "")


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


# -- rules held against an application's routes -----------------------------------------------


class RouteRuleWarning(UserWarning):
    """A scope or cost rule that matches no route of the application it protects."""


# A value each of Starlette's converters accepts, to build a path a template matches.
_SAMPLES = {
    "str": "x",
    "int": "1",
    "float": "1.5",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "path": "x/y",
}


def routes_of(app: Any) -> list[tuple[frozenset[str] | None, str]] | None:
    """The `(methods, path)` routes of a Starlette or FastAPI app, mounts included.

    `path` is in the rules' syntax (`/contacts/{id:int}`); `methods` is None for a route
    that takes every method. An app wrapped in middleware (`.app`) is looked through. None
    when no router is found: the app's routes are not known.
    """
    for _ in range(32):
        routes = getattr(app, "routes", None)
        if isinstance(routes, list):
            return list(_walk(routes, ""))
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


def _walk(routes: Iterable[Any], prefix: str) -> Iterator[tuple[frozenset[str] | None, str]]:
    from starlette.routing import Host, Mount, Route, WebSocketRoute

    for route in routes:
        if isinstance(route, Route):
            methods = frozenset(route.methods) if route.methods else None
            yield methods, prefix + route.path
        elif isinstance(route, Mount):
            inner = route.routes
            if inner:
                yield from _walk(inner, prefix + route.path)
            else:  # an app of its own: whatever is under its path may exist
                yield None, prefix + route.path + "/{rest:path}"
        elif isinstance(route, Host):
            yield from _walk(route.routes, prefix)
        elif hasattr(route, "effective_route_contexts"):  # FastAPI's included routers
            for context in route.effective_route_contexts():
                methods = frozenset(context.methods) if context.methods else None
                yield methods, prefix + context.path
        elif not isinstance(route, WebSocketRoute):
            yield None, prefix + "/{rest:path}"  # a route of unknown kind: it may be any path


def _sample(path: str) -> str | None:
    """A request path `path` (a rule or a route) matches; None for a custom converter."""
    missing = False

    def value(match: re.Match[str]) -> str:
        nonlocal missing
        found = _SAMPLES.get(match.group(2) or "str")
        missing = missing or found is None
        return found or ""

    sample = _PARAM.sub(value, path)
    return None if missing else sample


def _pattern(path: str) -> re.Pattern[str] | None:
    if "{" not in path:
        return re.compile(re.escape(path))
    try:
        return ScopeTable._compile(path, path)[0]
    except ConfigurationError:
        return None


def _paths_meet(rule_path: str, route_path: str) -> bool:
    """Whether some request path matches both the rule's path and the route's."""
    for one, other in ((rule_path, route_path), (route_path, rule_path)):
        sample, pattern = _sample(one), _pattern(other)
        if sample is None or pattern is None or pattern.fullmatch(sample):
            return True  # a custom converter: the route may well be it
    return False


def _methods_meet(method: str, methods: frozenset[str] | None) -> bool:
    return (
        method == "*"
        or methods is None
        or method in methods
        or (method == "HEAD" and "GET" in methods)
    )


def _matches(method: str, path: str, routes: list[tuple[frozenset[str] | None, str]]) -> bool:
    return any(
        _methods_meet(method, methods) and _paths_meet(path, route) for methods, route in routes
    )


def check_routes(
    app: Any,
    *,
    scopes: Mapping[str, object] | None = None,
    costs: Mapping[str, object] | None = None,
) -> list[str]:
    """Hold the rules (the keys of `scopes` and `costs`) against the routes of `app`.

    Every rule that matches no route of the app's router, or matches one only with a
    trailing slash added or taken away, is logged and warned about as a
    `RouteRuleWarning`; the messages are returned. Nothing is checked (and nothing said)
    when the app's router cannot be found. Call it once, at start (a lifespan's startup,
    or when the app is first seen).
    """
    routes = routes_of(app)
    if not routes:
        return []
    found: list[str] = []
    for kind, rules in (("scope", scopes), ("cost", costs)):
        for rule in rules or {}:
            message = _misfit(kind, rule, routes)
            if message is not None:
                found.append(message)
    for message in found:
        logger.warning("apikeys: %s", message)
        warnings.warn(message, RouteRuleWarning, stacklevel=3)
    return found


def _misfit(kind: str, rule: str, routes: list[tuple[frozenset[str] | None, str]]) -> str | None:
    """What is wrong with `rule` against `routes`; None when it matches one."""
    method, path = ScopeTable._parse_rule(rule)
    if _matches(method, path, routes):
        return None
    toggled = path[:-1] if path.endswith("/") and path != "/" else path + "/"
    if _matches(method, toggled, routes):
        return (
            f"{kind} rule {rule!r} matches no route of the app, but '{method} {toggled}' "
            "does: the app's route and the rule differ by a trailing slash, so the rule "
            "covers no request the app serves"
        )
    return (
        f"{kind} rule {rule!r} matches no route of the app: check its method and path "
        "against the app's routes (a rule written for another app, or a route renamed?)"
    )


# -- CORS preflights ------------------------------------------------------------------------------


def preflight_answerer(app: Any) -> Any | None:
    """The Starlette `CORSMiddleware` that answers CORS preflights for `app`, or None:
    `app` itself, one it wraps (`.app`), or one made from the `CORSMiddleware` a Starlette or
    FastAPI app lists in its middleware, with the same settings.

    `APIKeyMiddleware` answers a preflight without a key with its `preflight_response`, as
    that layer would, and never calls the app for it: nothing of the app (a middleware in
    between, an endpoint) runs for a request without a key.
    """
    from starlette.middleware.cors import CORSMiddleware

    for _ in range(32):
        if app is None:
            return None
        if isinstance(app, CORSMiddleware):
            return app
        for entry in getattr(app, "user_middleware", None) or ():
            if isinstance(entry.cls, type) and issubclass(entry.cls, CORSMiddleware):
                return entry.cls(_never_called, *entry.args, **entry.kwargs)
        app = getattr(app, "app", None)
    return None


async def _never_called(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
    raise RuntimeError("a preflight answerer never calls an app")


def serves_cors(app: Any) -> bool:
    """Whether Starlette's `CORSMiddleware` (or a subclass) runs inside `app` (see
    `preflight_answerer`): then a CORS preflight is answered without a key."""
    return preflight_answerer(app) is not None


def is_preflight(scope: Mapping[str, Any]) -> bool:
    """Whether the HTTP request `scope` is a CORS preflight: `OPTIONS` with an `Origin` and
    an `Access-Control-Request-Method` header (what `CORSMiddleware` answers itself)."""
    if scope.get("type") != "http" or scope.get("method") != "OPTIONS":
        return False
    names = {name for name, _ in scope.get("headers", ())}
    return b"origin" in names and b"access-control-request-method" in names
