"""Scopes: `resource:action` strings, `resource:*` grants and full access."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from apikeys.errors import InvalidKeyParameters

__all__ = [
    "FULL_ACCESS",
    "MAX_SCOPE_LENGTH",
    "GrantedScopes",
    "grants_for",
    "validate_scope",
    "validate_scopes",
]

MAX_SCOPE_LENGTH = 129
"""The longest scope: a resource and an action of 64 characters each, and the colon."""
_SCOPE_RE = re.compile(r"[a-z][a-z0-9_.-]{0,63}:(?:\*|[a-z][a-z0-9_.-]{0,63})")
FULL_ACCESS = "*"


def validate_scope(scope: str) -> str:
    """Return `scope` if it reads `resource:action` or `resource:*`, else raise."""
    if (
        not isinstance(scope, str)
        or len(scope) > MAX_SCOPE_LENGTH
        or _SCOPE_RE.fullmatch(scope) is None
    ):
        shown = repr(scope)
        shown = shown if len(shown) <= MAX_SCOPE_LENGTH else shown[:MAX_SCOPE_LENGTH] + "…"
        raise InvalidKeyParameters(
            f"invalid scope {shown}: a scope reads 'resource:action' or 'resource:*' "
            "(lowercase letters, digits, '_', '.', '-'; at most 64 on each side)"
        )
    return scope


def validate_scopes(scopes: Iterable[str]) -> tuple[str, ...]:
    """Validate scopes and return them sorted, without duplicates."""
    if isinstance(scopes, str):
        scopes = [scopes]
    return tuple(sorted({validate_scope(scope) for scope in scopes}))


class GrantedScopes(list[str]):
    """The scopes a key holds, answering `scope in granted` with wildcards and full access.

    It is a list of the grant strings (so `starlette.authentication.requires()` and
    anything else that reads `request.auth.scopes` work), whose `in` understands
    `resource:*` grants and full access (`*`), including scopes added after the key.
    """

    __slots__ = ("_exact", "_full", "_resources")

    def __init__(self, scopes: Iterable[str], *, full_access: bool = False) -> None:
        super().__init__([FULL_ACCESS] if full_access else scopes)
        self._full = full_access
        self._exact = frozenset(self)
        self._resources = frozenset(scope[:-2] for scope in self._exact if scope.endswith(":*"))

    def __contains__(self, scope: object) -> bool:
        if self._full or scope in self._exact:
            return True
        if not isinstance(scope, str):
            return False
        resource, sep, _ = scope.partition(":")
        return bool(sep) and resource in self._resources

    def __hash__(self) -> int:  # type: ignore[override]
        return id(self)

    def _refuse(self, *args: object, **kwargs: object) -> None:
        # Shared between requests (see grants_for): a change would leak into other requests.
        raise TypeError("a key's granted scopes cannot be changed")

    append = extend = insert = remove = clear = sort = reverse = _refuse
    pop = __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]

    def covers(self, required: Iterable[str]) -> bool:
        """True when these grants include every scope of `required`."""
        if self._full or self._exact.issuperset(required):
            return True
        for scope in required:  # noqa: SIM110 - a plain loop is the fastest here
            if scope not in self:
                return False
        return True

    def missing(self, required: Iterable[str]) -> list[str]:
        """The scopes of `required` that these grants do not cover."""
        if self._full:
            return []
        return [scope for scope in required if scope not in self]

    @property
    def full_access(self) -> bool:
        return self._full


@functools.lru_cache(maxsize=4096)
def grants_for(scopes: tuple[str, ...], full_access: bool) -> GrantedScopes:
    """The (shared, cached) `GrantedScopes` of a key's stored scopes."""
    return GrantedScopes(scopes, full_access=full_access)
