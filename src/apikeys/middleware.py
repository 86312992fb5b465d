"""`APIKeyMiddleware`: a pure ASGI middleware that authenticates, scopes and rate-limits.

```python
app = APIKeyMiddleware(
    app,
    manager=manager,
    scopes={"GET /api/v1/contacts": "contacts:read"},
    protect="/api/",
    rate_limit="100/minute",
    limiter_url="memory://",
)
```

Requests under `protect` need `Authorization: Bearer <key>`, or, with `header="X-API-Key"`,
the bare key in that one header instead (then Authorization is never read). A request that
passes reaches the app with `scope["apikey"]` (the `KeyRecord`), and `scope["auth"]` /
`scope["user"]` set the way Starlette's `AuthenticationMiddleware` sets them, so `requires()`
works. Every refusal is an `application/problem+json` response; nothing unexpected becomes
a 500 or lets a request through.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, NamedTuple, cast

from starlette.authentication import AuthCredentials, BaseUser

from apikeys.addresses import Allowlist, client_address
from apikeys.errors import (
    AuthenticationError,
    AuthUnavailable,
    ConfigurationError,
    CreditsExhausted,
    InsufficientScope,
    IPNotAllowed,
    MalformedAPIKey,
    MissingAPIKey,
    RateLimited,
)
from apikeys.manager import KeyManager
from apikeys.policies import Refill, parse_refill
from apikeys.problems import Headers, send_problem
from apikeys.ratelimit import DEFAULT_POLICY, PolicyDecision, RateDecision, RateLimiter
from apikeys.scopes import GrantedScopes, grants_for, validate_scope
from apikeys.types import ASGIApp, KeyRecord, Message, Receive, Scope, Send, utcnow

__all__ = [
    "APIKeyAuth",
    "APIKeyMiddleware",
    "APIKeyUser",
    "CostTable",
    "ScopeTable",
    "bearer_token",
    "check_address",
    "check_rate_limits",
    "credit_headers",
    "header_token",
    "rate_limit_headers",
    "spend_credit",
]

logger = logging.getLogger("apikeys")

# Longest value worth reading: "Bearer " and the longest key the format allows, with room.
MAX_AUTHORIZATION_LENGTH = 256
# An HTTP field name (RFC 9110, section 5.1): one or more token characters.
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT", "*"}
)
# {name} or {name:converter}; split() yields literal, name, converter, literal, ...
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z_][A-Za-z0-9_]*))?\}")


class APIKeyUser(BaseUser):
    """`scope["user"]` for a request authenticated by a key: the key is the principal."""

    __slots__ = ("record",)

    def __init__(self, record: KeyRecord) -> None:
        self.record = record

    def __repr__(self) -> str:
        return f"APIKeyUser(id={self.record.id!r}, workspace={self.record.workspace!r})"

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.record.name

    @property
    def identity(self) -> str:
        return self.record.id

    @property
    def workspace(self) -> str:
        return self.record.workspace


class APIKeyAuth(AuthCredentials):
    """`scope["auth"]`: its `scopes` understand `resource:*` grants and full access."""

    def __init__(self, scopes: GrantedScopes) -> None:
        self.scopes = scopes


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


def bearer_token(values: Sequence[bytes]) -> str:
    """The token of the request's `Authorization` header values, or the matching error.

    No header is `MissingAPIKey`; two headers, another scheme, an oversized or non-ASCII
    value is `MalformedAPIKey`. The scheme word is case-insensitive, followed by one space;
    spaces and tabs around the whole value are ignored.
    """
    if not values:
        raise MissingAPIKey()
    if len(values) > 1:  # two Authorization headers: refuse, never pick one
        raise MalformedAPIKey()
    # RFC 9110: a field value has no leading or trailing whitespace. Servers differ in
    # whether they strip it, so it is stripped here: "Bearer <key> " means one thing.
    value = values[0].strip(b" \t")
    if len(value) > MAX_AUTHORIZATION_LENGTH or value[:7].lower() != b"bearer ":
        raise MalformedAPIKey()
    try:
        return value[7:].decode("ascii")
    except UnicodeDecodeError:
        raise MalformedAPIKey() from None


def header_token(values: Sequence[bytes], header: str = "X-API-Key") -> str:
    """The key of the request's values of a header that carries the bare key (`X-API-Key`).

    `header` is the header's name as the application spells it, used only in the errors'
    details. No header is `MissingAPIKey`; two headers, an oversized or non-ASCII value is
    `MalformedAPIKey`. The value is the key alone, no scheme word; spaces and tabs around it
    are ignored. Whether the key is in the key format is `KeyManager.verify`'s to check.
    """
    if not values:
        raise _header_error(MissingAPIKey(), header)
    value = values[0].strip(b" \t")
    # Two headers of that name: refuse, never pick one.
    if len(values) > 1 or len(value) > MAX_AUTHORIZATION_LENGTH or not value.isascii():
        raise _header_error(MalformedAPIKey(), header)
    return value.decode("ascii")


def _header_error(exc: AuthenticationError, header: str) -> AuthenticationError:
    """`exc`, its detail naming `header` instead of Authorization when it is about the header.

    For `MissingAPIKey` and `MalformedAPIKey` (whoever raised them: `header_token` or
    `KeyManager.verify`) when the key is read from another header; other errors unchanged.
    """
    if exc.detail != type(exc).detail:
        return exc
    if isinstance(exc, MissingAPIKey):
        return MissingAPIKey(f"Send the API key in the {header} header.")
    if isinstance(exc, MalformedAPIKey):
        return MalformedAPIKey(f"The {header} header is not exactly one well-formed API key.")
    return exc


def _key_header(header: str) -> bytes:
    """The lower-case name of the header that carries the key; `b"authorization"` is Bearer.

    Raises `ConfigurationError` unless `header` is a valid HTTP field name.
    """
    if not isinstance(header, str) or _FIELD_NAME.fullmatch(header) is None:
        raise ConfigurationError(
            f"header {header!r} is not an HTTP header name: name one header, such as "
            "'X-API-Key', in letters, digits and !#$%&'*+-.^_`|~"
        )
    return header.lower().encode("ascii")


def _policy_name_text(name: str) -> str:
    """`name` as it can stand in a structured-field string: printable ASCII, no `"` or `\\`."""
    return "".join(char for char in name if " " <= char <= "~" and char not in '"\\')


@functools.lru_cache(maxsize=256)
def _policy_header(name: str, limit: int, window: int) -> tuple[bytes, bytes]:
    return b"ratelimit-policy", f'"{name}";q={limit};w={window}'.encode()


class _PolicySet(NamedTuple):
    """How the headers show a key's several policies: their names and RateLimit-Policy."""

    names: tuple[str, ...]
    policy_header: tuple[bytes, bytes]


@functools.lru_cache(maxsize=256)
def _policy_set(policies: tuple[tuple[str, int, int], ...]) -> _PolicySet:
    items = (f'"{name}";q={limit};w={window}' for name, limit, window in policies)
    return _PolicySet(
        tuple(name for name, _, _ in policies),
        (b"ratelimit-policy", ", ".join(items).encode()),
    )


def _single_headers(decision: RateDecision, policy_name: str) -> Headers:
    _, limit, window, remaining, reset_after = decision
    value = b'"%s";r=%d;t=%d' % (policy_name.encode(), remaining, reset_after)
    return [_policy_header(policy_name, limit, window), (b"ratelimit", value)]


def _policies_headers(decision: PolicyDecision, shown: _PolicySet) -> Headers:
    value = ", ".join(
        [
            f'"{name}";r={status[4]};t={status[5]}'
            for name, status in zip(shown.names, decision.policies, strict=True)
        ]
    )
    return [shown.policy_header, (b"ratelimit", value.encode())]


def rate_limit_headers(
    decision: RateDecision | PolicyDecision, policy_name: str = "default"
) -> Headers:
    """`RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11).

    One list item per policy: `"burst";q=10;w=1, "daily";q=10000;w=86400` and
    `"burst";r=3;t=1, "daily";r=9120;t=40210`. The policy named `default` (a key's one
    unnamed limit) is shown as `policy_name`.
    """
    if isinstance(decision, PolicyDecision):
        return _policies_headers(decision, _shown(decision, policy_name))
    return _single_headers(decision, policy_name)


def _shown(decision: PolicyDecision, policy_name: str) -> _PolicySet:
    return _policy_set(
        tuple(
            (policy_name if status.name == DEFAULT_POLICY else status.name, *status[2:4])
            for status in decision.policies
        )
    )


REFUSED_AFTER_AUTHENTICATION: frozenset[str] = frozenset(
    {"ip_not_allowed", "rate_limited", "insufficient_scope", "credits_exhausted"}
)
"""The refusals of a request whose key was verified: its usage history counts them."""
_LIMITER_CODES = frozenset({"rate_limited", "credits_exhausted"})


def check_address(scope: Scope, record: KeyRecord, trusted_proxies: int = 0) -> None:
    """Raise `IPNotAllowed` unless the request's client address is in the key's allowlist
    (a key without one allows every address). `trusted_proxies` as the middleware's."""
    allowlist = Allowlist.parse(record.allowed_ips)
    if allowlist is not None and not allowlist.allows(client_address(scope, trusted_proxies)):
        raise IPNotAllowed()


async def spend_credit(
    manager: KeyManager, limiter: RateLimiter, record: KeyRecord, headers: Headers, cost: int = 1
) -> Headers:
    """Spend `cost` of the key's credits and add them to the RateLimit `headers`; or refuse
    with `CreditsExhausted` after giving back what the rate limits charged the request, so a
    refused request is charged to nothing."""
    left = await manager.spend_credits(record, cost)
    refill = parse_refill(record.credit_refill) if record.credit_refill else None
    if left is None:
        await limiter.refund(record.id, record.rate_limit)
        retry = None
        if refill is not None:
            now = utcnow()
            retry = math.ceil((refill.next_start(now) - now).total_seconds())
        raise CreditsExhausted(retry)
    return credit_headers(headers, left, refill)


def credit_headers(
    headers: Headers, left: int, refill: Refill | None, now: datetime | None = None
) -> Headers:
    """`headers` with a `credits` item in `RateLimit` (the credits left, and `t`, the
    seconds to the next refill) and, for a key with a refill, in `RateLimit-Policy`."""
    item = f'"credits";r={left}'
    policy = None
    if refill is not None:
        now = now or utcnow()
        start, end = refill.period_start(now), refill.next_start(now)
        item += f";t={max(1, math.ceil((end - now).total_seconds()))}"
        policy = f'"credits";q={refill.amount};w={int((end - start).total_seconds())}'
    updated: Headers = []
    for name, value in headers:
        if name == b"ratelimit":
            value = value + b", " + item.encode()
        elif name == b"ratelimit-policy" and policy is not None:
            value = value + b", " + policy.encode()
        updated.append((name, value))
    return updated


async def check_rate_limits(
    limiter: RateLimiter, record: KeyRecord, policy_name: str = "default"
) -> tuple[Headers, RateLimited | None]:
    """Charge `record`'s request to its policies: the RateLimit headers, and the refusal.

    The refusal (None when admitted) is a `RateLimited` naming the violated policies, with
    `Retry-After` the longest of their `t`. What the integrations share with the middleware.
    """
    limit = record.rate_limit
    policies = limiter.policies(limit)
    if len(policies) == 1:
        name = policy_name if policies[0].name == DEFAULT_POLICY else policies[0].name
        decision = await limiter.hit(record.id, limit)
        refusal = None if decision.allowed else RateLimited(decision.reset_after, (name,))
        return _single_headers(decision, name), refusal
    decisions = await limiter.hit_policies(record.id, limit)
    shown = _shown(decisions, policy_name)
    headers = _policies_headers(decisions, shown)
    if decisions.allowed:
        return headers, None
    return headers, RateLimited(decisions.retry_after, _violated(decisions, shown))


def _violated(decision: PolicyDecision, shown: _PolicySet) -> tuple[str, ...]:
    return tuple(
        name
        for name, status in zip(shown.names, decision.policies, strict=True)
        if not status.allowed
    )


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


class APIKeyMiddleware:
    """Authenticate every HTTP and WebSocket request under `protect` with an API key.

    - `manager`: the `KeyManager` that verifies keys.
    - `scopes`: `{"METHOD /path/{param}": "resource:action"}` (see `ScopeTable`).
    - `protect`: a path prefix (or several) that needs a key; other paths pass through.
    - `rate_limit`: the default per-key limit (`APIKEYS_RATE_LIMIT`, else `100/minute`); a
      key's own `rate_limit` overrides it. Several named limits are written
      `"burst=10/second, daily=10000/day"` or given as `{"burst": "10/second", …}`: a
      request is admitted only if each admits it (docs/concepts/rate-limits.md).
    - `limiter_url`: `memory://` or `redis://…` shared by every process; or pass `limiter`.
    - `realm`: the realm of the `WWW-Authenticate` challenge.
    - `public`: exact paths under `protect` served without a key (an API's own OpenAPI
      document, say), so that everything else under the prefix, unknown paths included,
      is authenticated.
    - `unmapped`: what a restricted key may do on a protected route that no rule covers:
      `"deny"` (the default: 403 `insufficient_scope`) or `"allow"`. Full-access keys pass
      either way.
    - `header`: where the key is read. `"Authorization"` (the default, in any case) reads
      `Authorization: Bearer <key>`. Another header name, such as `"X-API-Key"`, reads the
      bare key from that one header (spaces and tabs around it ignored) and never reads
      Authorization; two headers of that name are `malformed_api_key`. For clients that
      cannot send Authorization. Refusals still carry `WWW-Authenticate: Bearer realm=…`.
      A name that is not a valid HTTP header name raises `ConfigurationError`.

    - `costs`: what a request costs in credits, by route (`{"POST /api/v1/campaigns/{id}/
      trigger": 5}`, the rules of `scopes`); 1 where no rule matches. For keys with credits.
    - `trusted_proxies`: how many proxies in front of the app append to `X-Forwarded-For`;
      the client address, checked against a key's `allowed_ips`, is then the one they wrote
      (counting from the right). 0 (the default) uses the connection's address and never
      reads the header.

    A key's policies are checked in this order: its address (403 `ip_not_allowed`, charged
    to nothing), its rate limits (429 `rate_limited`), its scopes (403
    `insufficient_scope`), then one of its credits is spent (429 `credits_exhausted`, and
    the rate limits charged for the request are given back).

    On `lifespan.shutdown` it writes the manager's buffered usage counts.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        manager: KeyManager,
        scopes: Mapping[str, str | Sequence[str]] | None = None,
        protect: str | Sequence[str] = "/",
        rate_limit: str | Mapping[str, str] | None = None,
        limiter_url: str = "memory://",
        limiter: RateLimiter | None = None,
        realm: str = "api",
        policy_name: str = "default",
        unmapped: Literal["deny", "allow"] = "deny",
        public: Sequence[str] = (),
        header: str = "Authorization",
        trusted_proxies: int = 0,
        costs: Mapping[str, int] | None = None,
    ) -> None:
        self.app = app
        self.manager = manager
        self.scopes = ScopeTable(scopes)
        self.protect = (protect,) if isinstance(protect, str) else tuple(protect)
        if not all(prefix.startswith("/") for prefix in self.protect):
            raise ConfigurationError("protect takes path prefixes that start with '/'")
        if isinstance(public, str) or not all(path.startswith("/") for path in public):
            raise ConfigurationError("public takes a list of paths that start with '/'")
        self.public = frozenset(public)
        self._owns_limiter = limiter is None
        self.limiter = limiter or RateLimiter(rate_limit, limiter_url)
        self.realm = realm
        self.policy_name = _policy_name_text(policy_name)
        # a key's rate_limit -> the name its one policy is shown with, or those of its policies
        self._shapes: dict[str | None, str | _PolicySet] = {}
        if unmapped not in ("deny", "allow"):
            raise ConfigurationError("unmapped takes 'deny' or 'allow'")
        self.allow_unmapped = unmapped == "allow"
        if isinstance(trusted_proxies, bool) or not isinstance(trusted_proxies, int):
            raise ConfigurationError("trusted_proxies takes a whole number of proxies")
        if trusted_proxies < 0:
            raise ConfigurationError("trusted_proxies must not be negative")
        self.trusted_proxies = trusted_proxies
        self.costs = CostTable(costs) if costs else None
        self.header = header
        self._header_name = _key_header(header)
        self._bearer = self._header_name == b"authorization"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope_type = scope["type"]
        if scope_type == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope_type not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        # Match on the path the app routes on: mounted apps and servers run with --root-path
        # put the root path in front of scope["path"] (as Starlette's get_route_path strips).
        path = scope["path"]
        root_path = scope.get("root_path")
        if root_path and path.startswith(root_path):
            rest = path[len(root_path) :]
            if not rest or rest[0] == "/":
                path = rest or "/"
        if not path.startswith(self.protect) or path in self.public:
            await self.app(scope, receive, send)
            return

        rate_headers: Headers | None = None
        record: KeyRecord | None = None
        try:
            header_name = self._header_name
            values = [value for name, value in scope["headers"] if name == header_name]
            if self._bearer:
                record = await self.manager.verify(bearer_token(values))
            else:
                record = await self.manager.verify(header_token(values, self.header))
            if record.allowed_ips:
                check_address(scope, record, self.trusted_proxies)  # before any charge
            limit = record.rate_limit
            shape = self._shapes.get(limit) or self._shape(limit)
            if isinstance(shape, str):
                # One policy: the fast path, as cheap as a key's limit has always been.
                decision = await self.limiter.hit(record.id, limit)
                rate_headers = _single_headers(decision, shape)
                if not decision.allowed:
                    raise RateLimited(decision.reset_after, (shape,))
            else:
                decisions = await self.limiter.hit_policies(record.id, limit)
                rate_headers = _policies_headers(decisions, shape)
                if not decisions.allowed:
                    raise RateLimited(decisions.retry_after, _violated(decisions, shape))
            grants = grants_for(record.scopes, record.access == "full")
            required = self.scopes.required(scope.get("method", "GET"), path)
            if required is None:
                # No rule covers the route: only full access, unless the app allows it.
                if not (grants.full_access or self.allow_unmapped):
                    raise InsufficientScope(())
            elif not grants.covers(required):
                raise InsufficientScope(required)
            if record.credits is not None:
                cost = 1 if self.costs is None else self.costs.cost(scope.get("method", ""), path)
                rate_headers = await spend_credit(
                    self.manager, self.limiter, record, rate_headers, cost
                )
        except AuthenticationError as exc:
            if record is not None and exc.code in REFUSED_AFTER_AUTHENTICATION:
                # Counted as a request of the key, and in its history as refused.
                self.manager.usage_buffer.refused(record.id, exc.code)
                if self.manager.telemetry.active and exc.code in _LIMITER_CODES:
                    self.manager.telemetry.limiter(record.id, exc.code)
            if not self._bearer:
                exc = _header_error(exc, self.header)
            await self._refuse(scope, send, exc, rate_headers)
            return
        except Exception:
            # A bug or an unforeseen store error: log it (no request data) and fail closed.
            logger.exception("apikeys: unexpected error while authenticating; answering 503")
            await self._refuse(scope, send, AuthUnavailable(), None)
            return

        if self.manager.telemetry.active:
            self.manager.telemetry.limiter(record.id, "allowed")
        scope["apikey"] = record
        scope["auth"] = APIKeyAuth(grants)
        scope["user"] = APIKeyUser(record)
        if scope_type == "websocket":
            await self.app(scope, receive, send)
            return

        async def send_with_rate_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *rate_headers]
            await send(message)

        await self.app(scope, receive, send_with_rate_headers)

    def _shape(self, limit: str | None) -> str | _PolicySet:
        shown = tuple(
            (
                self.policy_name if policy.name == DEFAULT_POLICY else policy.name,
                policy.item.amount,
                policy.item.get_expiry(),
            )
            for policy in self.limiter.policies(limit)
        )
        shape: str | _PolicySet = shown[0][0] if len(shown) == 1 else _policy_set(shown)
        if len(self._shapes) >= 10_000:
            self._shapes.clear()
        self._shapes[limit] = shape
        return shape

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        exc: AuthenticationError,
        extra: Headers | None,
    ) -> None:
        if scope["type"] == "websocket":
            # Closing before accepting makes the server answer the handshake with 403.
            await send({"type": "websocket.close", "code": 1008, "reason": exc.code})
            return
        await send_problem(send, exc, self.realm, extra)

    async def _shutdown(self) -> None:
        try:
            await self.manager.flush()
        except Exception as exc:
            logger.error(
                "apikeys: could not write usage counts at shutdown: %s", type(exc).__name__
            )
        if self._owns_limiter:
            try:
                await self.limiter.aclose()
            except Exception as exc:
                logger.warning("apikeys: could not close the limiter: %s", type(exc).__name__)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = False

        async def lifespan_receive() -> Message:
            nonlocal received
            received = True
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self._shutdown()
            return message

        try:
            await self.app(scope, lifespan_receive, send)
        except Exception:
            if received:
                raise  # the app speaks lifespan and failed: that is the server's to report
            # The app does not speak lifespan at all (it refused the scope before reading
            # a message): speak it here, so usage is still written on graceful shutdown.
            await self._own_lifespan(receive, send)

    async def _own_lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return
