"""Scope rules and Django's URLconf: Django's route syntax refused with the right spelling,
the rules no route answers, and the rules Django REST framework views declare.

A rule is `"METHOD /path/{param}"` (see `apikeys.routes`); a Django route is
`"path/<int:pk>/"`. `spelled(rule)` is the rule for a Django route, `probe(rule)` the paths a
rule matches, to ask Django's resolver whether any route answers them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.exceptions import Resolver404
from django.urls.resolvers import LocalePrefixPattern, RoutePattern

from apikeys.errors import ConfigurationError
from apikeys.routes import ScopeTable

__all__ = ["DRFRoute", "answered", "check_syntax", "drf_routes", "probe", "resolves", "spelled"]

# Django's <converter:name> or <name>.
_DJANGO_PARAM = re.compile(r"<(?:(?P<converter>[^>:]+):)?(?P<name>[^>]+)>")
# apikeys' {name} or {name:converter}.
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z_][A-Za-z0-9_]*))?\}")
# Django's converters as apikeys spells them (slug and custom ones are one plain segment).
_CONVERTERS = {"int": ":int", "uuid": ":uuid", "path": ":path", "str": "", "slug": ""}
# What each converter of a rule is tried with, to find the Django route it matches.
_SAMPLES: dict[str, tuple[str, ...]] = {
    "int": ("1",),
    "float": ("1",),
    "uuid": ("00000000-0000-4000-8000-000000000000",),
    "path": ("x", "1", "x/1"),
    "str": ("1", "x", "00000000-0000-4000-8000-000000000000"),
}
_MAX_PROBES = 64


def spelled(django_route: str) -> str:
    """A Django route's path (`api/v1/contacts/<int:pk>/`) as a rule's path
    (`/api/v1/contacts/{pk:int}/`)."""

    def convert(match: re.Match[str]) -> str:
        converter = match.group("converter") or "str"
        return "{" + match.group("name") + _CONVERTERS.get(converter, "") + "}"

    return "/" + _DJANGO_PARAM.sub(convert, django_route).lstrip("/")


def check_syntax(rules: Mapping[str, Any] | None, what: str) -> None:
    """Refuse a rule written in Django's syntax, naming the rule as apikeys spells it."""
    for rule in rules or {}:
        if isinstance(rule, str) and _DJANGO_PARAM.search(rule):
            method, _, path = rule.strip().partition(" ")
            right = f"{method} {spelled(path.strip())}"
            raise ConfigurationError(
                f"invalid {what} rule {rule!r}: Django's <converter:name> is written "
                f"{{name:converter}} here: {right!r}"
            )


def probe(path: str) -> Iterator[str]:
    """Concrete paths that the rule path `path` matches (each parameter tried with a few
    values), at most a few dozen."""
    parts = _PARAM.split(path)
    choices: list[tuple[str, ...]] = []
    for index in range(1, len(parts), 3):
        choices.append(_SAMPLES.get(parts[index + 1] or "str", ("1", "x")))
    for values in itertools.islice(itertools.product(*choices), _MAX_PROBES):
        text = parts[0]
        for position, value in enumerate(values):
            text += value + parts[3 * position + 3]
        yield text


def resolves(path: str, urlconf: str | None = None) -> bool:
    """Whether a route of the URLconf answers `path`."""
    try:
        get_resolver(urlconf).resolve(path)
    except Resolver404:
        return False
    return True


def answered(rule_path: str, urlconf: str | None = None) -> bool:
    """Whether a route of the URLconf answers a path the rule path matches. A rule ending in
    `{name:path}` (everything under a prefix) is answered when a route lies under its
    prefix, or when the URLconf has routes given as regular expressions (which no prefix
    can be compared with)."""
    if any(resolves(candidate, urlconf) for candidate in probe(rule_path)):
        return True
    match = _PARAM.search(rule_path)
    if match is None or match.group(2) != "path" or match.end() != len(rule_path):
        return False
    prefix = rule_path[: match.start()]
    for route, _ in _walk(get_resolver(urlconf).url_patterns, "", regex=True):
        if route is None or spelled(route).startswith(prefix):
            return True
    return False


@dataclass(frozen=True)
class DRFRoute:
    """A route served by a Django REST framework view that declares `required_scopes`."""

    path: str
    """As a rule spells it: `/api/v1/contacts/{pk:int}/`."""
    view: type
    declared: Any
    """The view's `required_scopes`: a list, or a dict by method (`*` for the others)."""

    def rules(self) -> dict[str, tuple[str, ...]]:
        """The scope rules the view's `required_scopes` amount to (methods it requires no
        scope for have none: any key may call them)."""
        declared = self.declared
        if isinstance(declared, str):
            declared = [declared]
        by_method = declared if isinstance(declared, Mapping) else {"*": declared}
        return {
            f"{method.upper()} {self.path}": tuple(scopes)
            for method, scopes in by_method.items()
            if scopes and isinstance(method, str)
        }


def drf_routes(urlconf: str | None = None) -> list[DRFRoute]:
    """The routes of the URLconf served by a DRF view that authenticates with apikeys
    (`APIKeyAuthentication` or `HasScopes`) and declares `required_scopes`. Routes given
    as regular expressions (`re_path`) are read when they are plain paths with named
    groups, as DRF's routers write them; any other is left out: no rule can spell it."""
    found: list[DRFRoute] = []
    for route, callback in _walk(get_resolver(urlconf).url_patterns, ""):
        view = getattr(callback, "cls", None)
        if view is None or getattr(view, "required_scopes", None) is None or not _ours(view):
            continue
        path = spelled(route)
        try:
            ScopeTable({f"GET {path}": "x:y"})
        except ConfigurationError:
            continue  # a route apikeys' rules cannot spell (`<path:p>/edit`)
        found.append(DRFRoute(path, view, view.required_scopes))
    return found


def _walk(patterns: Any, prefix: str, *, regex: bool = False) -> Iterator[tuple[Any, Any]]:
    """Each route of `patterns` as one Django route string, with its view; a route given as
    a regular expression (`re_path`) that `_from_regex` cannot read is left out, or yielded
    as None with `regex`."""
    for pattern in patterns:
        kind = pattern.pattern
        if isinstance(kind, LocalePrefixPattern):
            text = kind.language_prefix
        elif isinstance(kind, RoutePattern):
            text = str(kind._route)
        elif (found := _from_regex(str(kind._regex))) is not None:
            text = found
        else:
            if regex:
                yield None, None
            continue
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, prefix + text, regex=regex)
        elif isinstance(pattern, URLPattern):
            yield prefix + text, pattern.callback


# (?P<name>…) without nested groups: one parameter, as DRF's routers write them.
_NAMED_GROUP = re.compile(r"\(\?P<(?P<name>[A-Za-z_][A-Za-z0-9_]*)>[^()]*\)")
_REGEX_SYNTAX = re.compile(r"[\\^$.*+?()\[\]{}|]")


def _from_regex(regex: str) -> str | None:
    """A `re_path` regular expression as a Django route, when it is a plain path with named
    one-segment groups (`^api/v1/tags/(?P<pk>[^/.]+)/$`, as DRF's routers write them):
    `api/v1/tags/<pk>/`. None for anything else (no rule can spell it)."""
    text = regex.removeprefix("^")
    ends = text.endswith("$")
    text = text.removesuffix("$")
    if "{" in text or "}" in text:
        return None
    text = _NAMED_GROUP.sub(lambda match: "<" + match.group("name") + ">", text)
    if _REGEX_SYNTAX.search(text.replace("<", "").replace(">", "")):
        return None
    if not ends and not text.endswith("/"):
        return None  # a prefix of an include() ends with "/"; anything else is open-ended
    return text


def _ours(view: type) -> bool:
    """Whether the DRF view checks keys with apikeys' classes (else its required_scopes
    are not ours to enforce)."""
    try:
        from apikeys.integrations.django.drf import APIKeyAuthentication, HasScopes
    except ModuleNotFoundError:  # pragma: no cover - DRF views without DRF installed
        return False
    classes = [*getattr(view, "authentication_classes", ()), *_permissions(view)]
    return any(
        isinstance(cls, type) and issubclass(cls, (APIKeyAuthentication, HasScopes))
        for cls in classes
    )


def _permissions(view: type) -> Iterator[Any]:
    """The view's permission classes, with those inside `A | B` and `A & B`."""
    pending = list(getattr(view, "permission_classes", ()))
    while pending:
        item = pending.pop()
        yield item
        pending.extend(
            getattr(item, name)
            for name in ("op1_class", "op2_class", "op1", "op2")
            if hasattr(item, name)
        )
