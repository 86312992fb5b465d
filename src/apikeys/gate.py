"""The one request path: every entry point admits or refuses a request here.

`Gate.admit` reads the key (`Authorization: Bearer <key>`, or the bare key in one named
header), verifies it, checks the client address against the key's allowlist, charges its
rate limits, checks its scopes (against a `ScopeTable` of routes and the scopes an endpoint
asks for), then spends its credits (what a `CostTable` says the route costs). On admission
it sets `scope["apikey"]`, `scope["auth"]` and `scope["user"]` and answers the `RateLimit`
headers; on refusal it raises the `AuthenticationError` to answer with, after the
bookkeeping every entry point shares: a key's request refused after it was authenticated
is counted in the key's usage history under its code, and the limiter's refusals in the
telemetry. Anything unexpected is logged and refused as 503 `auth_unavailable`: fail
closed, never a 500 and never an open door.

`APIKeyMiddleware`, the Starlette backend, the FastAPI dependency and the Django classes
are adapters around one `Gate`: they differ in where the request comes from and how the
refusal is sent, never in what is checked or counted.

The path has one body, written as h11 writes a protocol: `Gate.decide` is a pure decision
core (no await, no I/O) that takes the request and what has been loaded so far, and either
answers, refuses, or answers an `Admission` naming what it must load next (the key from the
store, the limiter's server's charge, the credits, their refund on refusal); `Gate.complete`
is the thin async shell that loads it and asks the core again. `admit` is the two together.
The common request (a key the manager holds, limits decided in this process, no credits) is
answered by the core's first call, without an await: what it needs of a key's version is
prepared once (`_Prepared`), an input to the one body, never a second one. The middleware
calls `decide` itself and awaits `complete` only for an `Admission`, sparing a coroutine per
request (docs/performance.md measures the path).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, Literal, NamedTuple

from starlette.authentication import AuthCredentials, BaseUser

from apikeys.addresses import Allowlist, client_address
from apikeys.bounded import remember
from apikeys.credentials import KeyReader, LegacyToken
from apikeys.errors import (
    AuthenticationError,
    AuthUnavailable,
    ConfigurationError,
    CreditsExhausted,
    InsufficientScope,
    IPNotAllowed,
    RateLimited,
)
from apikeys.manager import KeyManager
from apikeys.manager.credits import spends_identity
from apikeys.outages import OutageLog
from apikeys.policies import parse_refill
from apikeys.problems import Headers
from apikeys.ratelimit import (
    Charge,
    Plan,
    RateDecision,
    RateLimiter,
)
from apikeys.ratelimit.decisions import decision
from apikeys.ratelimit.headers import (
    OnePolicy,
    PolicySet,
    credit_headers,
    credits_exhausted,
    policies_headers,
    policy_name_text,
    rate_limit_headers,
    rate_limited,
    shape_for,
    single_headers,
)
from apikeys.ratelimit.limiter import IDENTITY_POLICY_PREFIX
from apikeys.routes import CostTable, ScopeTable
from apikeys.scopes import GrantedScopes, grants_for
from apikeys.stores.contract import CreditSpend
from apikeys.stores.shared import LEGACY_SCHEME
from apikeys.types import KeyRecord, Scope

if TYPE_CHECKING:
    from apikeys.identities import IdentityRecord

__all__ = [
    "REFUSED_AFTER_AUTHENTICATION",
    "APIKeyAuth",
    "APIKeyUser",
    "Admission",
    "Gate",
    "check_address",
    "check_rate_limits",
    "credit_headers",
    "rate_limit_headers",
    "route_path",
    "spend_credit",
]

logger = logging.getLogger("apikeys")


class APIKeyUser(BaseUser):
    """`scope["user"]` for a request authenticated by a key: the key is the principal."""

    __slots__ = ("record",)
    record: KeyRecord

    def __init__(self, record: KeyRecord) -> None:
        object.__setattr__(self, "record", record)

    def __setattr__(self, name: str, value: object) -> None:
        # One per key version, shared by its requests (see Gate.decide): read-only.
        raise AttributeError("an APIKeyUser cannot be changed")

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
        object.__setattr__(self, "scopes", scopes)

    def __setattr__(self, name: str, value: object) -> None:
        # One per key version, shared by its requests (see Gate.decide): read-only.
        raise AttributeError("an APIKeyAuth cannot be changed")


# What the core asks the shell to load (`Admission.need`), in the order of the checks.
_KEY = 1  # the key from the store: `await manager.verify(token)`
_CHARGE = 2  # the limiter's server's charge: the awaitable `RateLimiter.charge` handed back
_SPEND = 3  # the key's credits: `await manager.spend_credits(record, cost)`
_REFUND = 4  # the rate limits' charge given back, credits refused: `await limiter.refund(…)`
_LEGACY = 5  # an imported key sent under a legacy scheme: `await manager.verify_imported(…)`
_IDENTITY = 6  # the key's identity, not held: `await manager.usable_identity(…)`


# (method, path) -> the scopes a key lacks for that route (None: it may take it)
_RouteAnswers = dict[tuple[str, str], tuple[str, ...] | None]
# Distinct grants whose `scope["auth"]` and route answers a gate shares between keys.
_SHARED_GRANTS: Final = 4096


class _Prepared(NamedTuple):
    """What the core needs of one version of a key (and of its identity's, for a key of
    one), made at its first request: the objects the request's scope gets, its grants, its
    limits (its identity's with them) as the limiter charges them (`plan`) and as the
    headers show them (`shape`), whether it spends credits, and its answers by route (the
    answers and `auth` shared by every key with the same grants)."""

    record: KeyRecord
    grants: GrantedScopes
    auth: APIKeyAuth
    user: APIKeyUser
    routes: _RouteAnswers
    plan: Plan
    shape: OnePolicy | PolicySet
    spends: bool  # whether a request spends credits (the key's, its identity's)
    identity: IdentityRecord | None  # the version of the key's identity it was made with


class _Uncounted(Exception):
    """Raised inside the core for a refusal that is not the verified key's own (its
    identity's): refused as `verify` refuses it, the request not counted."""

    def __init__(self, refusal: AuthenticationError) -> None:
        self.refusal = refusal


class _Awaiting(Exception):
    """Raised inside the core by a helper that finds something must be loaded first: the
    core answers its `admission`."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission


class Admission:
    """A request's admission between two calls of `Gate.decide`: what the core needs
    loaded next (`need`), and what has been loaded so far (the verified `record`, the
    limiter's `charged` answer, the credits `spent`, a `failure` to refuse with).

    Made only when the core cannot answer at once; `Gate.complete` loads and asks again.
    """

    __slots__ = (
        "charged",
        "charging",
        "cost",
        "failure",
        "headers",
        "identity",
        "need",
        "record",
        "spent",
        "token",
    )

    def __init__(self, need: int, token: str) -> None:
        self.need = need
        self.token = token
        self.record: KeyRecord | None = None
        self.charging: Awaitable[Charge] | None = None
        self.charged: Charge = ()
        self.headers: Headers | None = None
        self.cost = 1
        self.failure: Exception | None = None
        self.identity: IdentityRecord | None = None
        self.spent: CreditSpend | None = None


def check_address(scope: Scope, record: KeyRecord, trusted_proxies: int = 0) -> None:
    """Raise `IPNotAllowed` unless the request's client address is in the key's allowlist
    (a key without one allows every address). `trusted_proxies` as the middleware's."""
    allowlist = Allowlist.parse(record.allowed_ips)
    if allowlist is not None and not allowlist.allows(client_address(scope, trusted_proxies)):
        raise IPNotAllowed()


async def spend_credit(
    manager: KeyManager,
    limiter: RateLimiter,
    record: KeyRecord,
    headers: Headers,
    cost: int = 1,
    *,
    identity: IdentityRecord | None = None,
) -> Headers:
    """Spend `cost` of the key's credits, and of its identity's, and add them to the
    RateLimit `headers`; or refuse with `CreditsExhausted` after giving back what the rate
    limits charged the request (the identity's too), so a refused request is charged to
    nothing. A key of an identity spends its identity's credits with its own
    (`KeyManager.spend_request_credits`); `identity` is its record, read here when not given.
    (What `Gate.admit` does, for code of its own.)"""
    if record.identity is not None and (identity is None or identity.id != record.identity):
        identity = await manager.usable_identity(record.identity)
    spent = await manager.spend_request_credits(record, identity, cost)
    if spent.refused is not None:
        await limiter.refund(
            record.id,
            record.rate_limit,
            identity=record.identity,
            identity_policies=None if identity is None else identity.rate_limit,
        )
        raise _exhausted(spent, record, identity)
    return _spent_headers(headers, spent, record, identity)


def _spent_headers(
    headers: Headers, spent: CreditSpend, record: KeyRecord, identity: IdentityRecord | None
) -> Headers:
    """`headers` with the credits left: the key's, then its identity's (`identity.credits`)."""
    if spent.key_left is not None:
        refill = parse_refill(record.credit_refill) if record.credit_refill else None
        headers = credit_headers(headers, spent.key_left, refill)
    if spent.identity_left is not None and identity is not None:
        refill = parse_refill(identity.credit_refill)
        headers = credit_headers(headers, spent.identity_left, refill, name=_ICREDITS)
    return headers


def _exhausted(
    spent: CreditSpend, record: KeyRecord, identity: IdentityRecord | None
) -> CreditsExhausted:
    """The refusal of a spend refused: `Retry-After` the refill of the side that refused."""
    refilled = record.credit_refill
    if spent.refused == "identity" and identity is not None:
        refilled = identity.credit_refill
    return credits_exhausted(parse_refill(refilled) if refilled else None)


def _identity_limit(record: KeyRecord, identity: IdentityRecord | None) -> str | None:
    """The limits of `record`'s identity, which its requests are charged with too (None: the
    key has no identity, or the identity no limits); `ConfigurationError` when the key has
    an identity and `identity` is not its record: charging the key alone would let it past
    its identity's limits."""
    if record.identity is None:
        return None
    if identity is None or identity.id != record.identity:
        raise ConfigurationError(
            f"the key belongs to identity {record.identity!r}, whose limits it is charged "
            "with too: pass identity=await manager.usable_identity(record.identity)"
        )
    return identity.rate_limit


async def check_rate_limits(
    limiter: RateLimiter,
    record: KeyRecord,
    policy_name: str = "default",
    *,
    identity: IdentityRecord | None = None,
) -> tuple[Headers, RateLimited | None]:
    """Charge `record`'s request to its policies: the RateLimit headers, and the refusal.

    The refusal (None when admitted) is a `RateLimited` naming the violated policies, with
    `Retry-After` the longest of their `t`. A key of an identity is charged with its
    identity's policies too, all or nothing: pass the identity's record as `identity`
    (`await manager.usable_identity(record.identity)`, which also refuses a key whose
    identity is off); without it such a key raises `ConfigurationError`. What the
    integrations share with the middleware.
    """
    identity_limit = _identity_limit(record, identity)
    plan = limiter.plan(
        record.id, record.rate_limit, identity=record.identity, identity_policies=identity_limit
    )
    charged = limiter.charge(plan)
    if not isinstance(charged, tuple):
        charged = await charged
    shape = shape_for(limiter, record.rate_limit, policy_name, identity_limit)
    if isinstance(shape, OnePolicy):
        policy = decision(plan, charged).policies[0]
        headers = single_headers(RateDecision(*policy[1:]), shape.name)
    else:
        headers = policies_headers(charged, shape)
    refusal = rate_limited(charged, shape) if min(charged[::2]) < 0 else None
    return headers, refusal


def route_path(scope: Scope) -> str:
    """The path the app routes on: `scope["path"]` without the root path that mounted apps
    and servers run with `--root-path` put in front of it (as Starlette's routing strips)."""
    path: str = scope["path"]
    root_path = scope.get("root_path")
    if root_path and path.startswith(root_path):
        rest = path[len(root_path) :]
        if not rest or rest[0] == "/":
            return rest or "/"
    return path


REFUSED_AFTER_AUTHENTICATION: frozenset[str] = frozenset(
    {"ip_not_allowed", "rate_limited", "insufficient_scope", "credits_exhausted"}
)
"""The refusals of a request whose key was verified: its usage history counts them."""
# What the limiter telemetry reports as refused (the other refusals are not the limiter's).
_LIMITER_CODES = frozenset({"rate_limited", "credits_exhausted"})


def _waiting(
    admission: Admission | None,
    need: int,
    record: KeyRecord,
    headers: Headers | None,
    charging: Charge | Awaitable[Charge] | None,
) -> Admission:
    """`admission` (a new one on the core's first call) needing `need` loaded."""
    if admission is None:
        admission = Admission(need, "")
    admission.need = need
    admission.record = record
    admission.headers = headers
    admission.charging = charging  # type: ignore[assignment]  # what charge handed back
    return admission


def _resumed(admission: Admission) -> tuple[KeyRecord, int, Charge]:
    """What `admission` has loaded: the key's record, how far the core got and the
    limits' charge; or the failure loading raised, raised."""
    if admission.failure is not None:
        raise admission.failure
    if admission.record is None:  # pragma: no cover - the shell loads a key or fails
        raise AuthUnavailable()
    return admission.record, admission.need, admission.charged


def _credited(admission: Admission, record: KeyRecord) -> Headers | Admission:
    """After the credits were spent: the headers with the credits left (the key's, then
    its identity's as `identity.credits`); or, none taken, the limits' charge to give
    back, and once given back the refusal (`Retry-After` the refill of the side that
    refused)."""
    spent = admission.spent
    assert spent is not None
    if admission.need == _SPEND:
        if spent.refused is None:
            return _spent_headers(admission.headers or [], spent, record, admission.identity)
        admission.need = _REFUND  # a refused request is charged to nothing
        return admission
    raise _exhausted(spent, record, admission.identity)


_ICREDITS = IDENTITY_POLICY_PREFIX + "credits"


class Gate:
    """Admits or refuses a request with an API key: the request path of every entry point.

    - `manager`: the `KeyManager` that verifies keys and counts their use.
    - `limiter`: the `RateLimiter` that holds the keys' rate limits; None takes the
      manager's (`KeyManager.limiter`), which the integrations share. Either way the
      manager sends its thresholds as webhooks (`KeyManager.observe_limiter`).
    - `scopes`: a route table (`ScopeTable`, or its rules) of the scopes each route needs;
      None checks only the scopes `admit` is given.
    - `unmapped`: what a restricted key may do on a route no rule of `scopes` covers:
      `"deny"` (403 `insufficient_scope`) or `"allow"`. Full-access keys pass either way.
    - `costs`: what a request costs in credits by route (`CostTable`, or its rules); 1
      where no rule matches.
    - `header`: `"Authorization"` reads `Authorization: Bearer <key>`; another header name
      reads the bare key from that one header, and never Authorization.
    - `policy_name`: how the `RateLimit` headers name a key's one unnamed limit.
    - `trusted_proxies`: how many proxies append to `X-Forwarded-For` (see
      `APIKeyMiddleware`); 0 uses the connection's address.
    - `legacy_schemes`: Authorization schemes read besides Bearer while a migration lasts
      (`("Api-Key",)`), for imported keys only (apikeys' own: 401 `malformed_api_key`);
      counted in the key's usage history as `legacy_scheme`. None by default.

    Everything that can be decided once is decided here; `admit` does only the request's
    work, in the order the contract gives: address, rate limits, scopes, credits.
    """

    def __init__(
        self,
        manager: KeyManager,
        *,
        limiter: RateLimiter | None = None,
        scopes: ScopeTable | Mapping[str, str | Sequence[str]] | None = None,
        unmapped: Literal["deny", "allow"] = "deny",
        costs: CostTable | Mapping[str, int] | None = None,
        header: str = "Authorization",
        policy_name: str = "default",
        trusted_proxies: int = 0,
        legacy_schemes: Sequence[str] = (),
    ) -> None:
        if unmapped not in ("deny", "allow"):
            raise ConfigurationError("unmapped takes 'deny' or 'allow'")
        if type(trusted_proxies) is not int or trusted_proxies < 0:
            raise ConfigurationError("trusted_proxies takes a whole number of proxies, 0 or more")
        self.manager = manager
        self.limiter = limiter if limiter is not None else manager.limiter
        if limiter is not None:
            manager.observe_limiter(limiter)  # its thresholds become webhooks, as the manager's
        self.scopes = (
            scopes if scopes is None or isinstance(scopes, ScopeTable) else ScopeTable(scopes)
        )
        self.allow_unmapped = unmapped == "allow"
        self.costs = (
            costs
            if costs is None or isinstance(costs, CostTable)
            else CostTable(costs)
            if costs
            else None
        )
        self.reader = KeyReader(header, legacy_schemes)
        self.outages = OutageLog()
        """Reads the key from a request's headers."""
        self.header = header
        self.header_name = self.reader.header_name
        """The lower-case name of the header the key is read from."""
        self.legacy_schemes = tuple(legacy_schemes)  # as given
        self.policy_name = policy_name_text(policy_name)
        self.trusted_proxies = trusted_proxies
        # a key's rate_limit (with its identity's) -> the name its one policy is shown with,
        # or those of its policies
        self._shapes: dict[object, OnePolicy | PolicySet] = {}
        # key id -> what the core needs of the key's latest version seen (a key of no
        # identity), and the same of a key of an identity with its identity's version
        self._prepared: dict[str, _Prepared] = {}
        self._of_identities: dict[str, _Prepared] = {}
        # a key's grants -> its `scope["auth"]` and its answers by route: they follow from
        # the grants alone, so keys with the same scopes share them (a key costs less memory)
        self._by_grants: dict[GrantedScopes, tuple[APIKeyAuth, _RouteAnswers]] = {}
        # (method, path) -> the scopes the route needs (None: no rule)
        self._routes: dict[tuple[str, str], tuple[str, ...] | None] = {}

    def decide(
        self,
        scope: Scope,
        path: str,
        required: Sequence[str] = (),
        admission: Admission | None = None,
    ) -> Headers | Admission:
        """The decision core of `admit`: no await, no I/O. Answers the `RateLimit` headers
        (the request admitted, `scope` set), raises the refusal (booked by `refused`), or
        answers the `Admission` saying what must be loaded before it can go on.

        Called first with the request alone; then, by `complete`, with the `Admission` it
        answered, once what it needs is loaded. The checks, in the contract's order: the
        key's header, the key (`KeyManager.verify_now`, else the store), its address, its
        rate limits (`RateLimiter.charge`, else the limiter's server), its scopes, its
        credits (spent in the store, and the limits' charge given back on refusal). The
        request is counted in the key's usage once, when the core answers or refuses
        after the key was verified. What it makes of each version of a key (its grants,
        `scope["auth"]` and `scope["user"]`, its limits' plan and headers, its answers by
        route) is made at the version's first request: the common case (a key held by the
        manager, limits decided in this process, no credits) is answered by the first call.
        """
        manager = self.manager
        record: KeyRecord | None = None
        rate_headers: Headers | None = None
        try:
            if admission is None:
                token = self.reader.read(scope["headers"])
                # Format, checksum, hash, state and expiry; counted once the core answers.
                # The key's identity (if any) is checked below, where it is charged.
                record = manager.verify_now(token, count=False, identity=False)
                if record is None:
                    return Admission(_KEY, token)  # the store must be read
                loaded = 0
            else:
                # Known before a failure is raised: a request refused after its key was
                # verified is counted, and carries its limits' headers.
                record, rate_headers = admission.record, admission.headers
                record, loaded, charged = _resumed(admission)
            prepared = self._prepared.get(record.id)
            if prepared is None or prepared.record is not record:
                # (A key of an identity is never found there: see `_prepare`.)
                prepared = self._prepare(record, admission)
            if loaded < _CHARGE:
                if record.allowed_ips:
                    check_address(scope, record, self.trusted_proxies)  # before any charge
                answer = self.limiter.charge(prepared.plan)
                if type(answer) is tuple:
                    charged = answer
                else:
                    waiting = _waiting(admission, _CHARGE, record, None, answer)
                    waiting.identity = prepared.identity  # charged with this version
                    return waiting
            if loaded <= _CHARGE:
                # The limits' headers, then their refusal (a remaining below 0, `~left`).
                shape = prepared.shape
                if type(shape) is OnePolicy:
                    least = remaining = charged[0]
                    shown = remaining if remaining >= 0 else ~remaining
                    value = b"%s%d;t=%d" % (shape.start, shown, charged[1])
                    rate_headers = [shape.policy_header, (b"ratelimit", value)]
                else:
                    rate_headers = policies_headers(charged, shape)  # type: ignore[arg-type]
                    least = min(charged[::2])
                if least < 0:
                    raise rate_limited(charged, shape)
                # The scopes: the route table's answer for this key version and route,
                # worked out once, then what the endpoint requires.
                route = (scope.get("method", "GET"), path)
                try:
                    lacking = prepared.routes[route]
                except KeyError:
                    lacking = self._lacking(prepared, route)
                if lacking is not None:
                    raise InsufficientScope(lacking)
                if required and not prepared.grants.covers(required):
                    raise InsufficientScope(required)
                if prepared.spends:
                    return self._spending(scope, path, admission, prepared, rate_headers)
            else:
                credited = _credited(admission, record)  # type: ignore[arg-type]
                if isinstance(credited, Admission):
                    return credited
                rate_headers = credited
        except Exception as exc:
            return self._failure(record, exc, rate_headers)
        manager.usage_buffer.record(record.id)
        if manager.telemetry.active:
            manager.telemetry.limiter(record.id, "allowed")
        scope["apikey"] = record
        scope["auth"] = prepared.auth
        scope["user"] = prepared.user
        return rate_headers

    def _failure(
        self, record: KeyRecord | None, exc: Exception, rate_headers: Headers | None
    ) -> Admission:
        """What the core raised: a key under a legacy scheme, to load (an imported key's,
        from the store); else the refusal, raised."""
        if type(exc) is LegacyToken:
            return Admission(_LEGACY, exc.token)
        if type(exc) is _Awaiting:
            return exc.admission
        if type(exc) is _Uncounted:
            raise self._refusal(None, exc.refusal, None) from None
        raise self._refusal(record, exc, rate_headers) from None

    def _refusal(
        self, record: KeyRecord | None, exc: Exception, rate_headers: Headers | None
    ) -> AuthenticationError:
        """The core's refusal for `exc`, raised while deciding: the request counted (when
        its key was verified) and the refusal booked by `refused`. Anything but an
        `AuthenticationError` is a bug or an unforeseen store error: logged (no request
        data) and refused as 503, failing closed."""
        if record is not None:
            self.manager.usage_buffer.record(record.id)
        if isinstance(exc, AuthenticationError):
            return self.refused(record, exc, rate_headers)
        if isinstance(exc, ConfigurationError):  # a pepper found wrong at first use: said plainly
            logger.error("apikeys: %s; answering 503", exc)
        else:
            logger.exception("apikeys: unexpected error while authenticating; answering 503")
        return AuthUnavailable()

    def _spending(
        self,
        scope: Scope,
        path: str,
        admission: Admission | None,
        prepared: _Prepared,
        headers: Headers,
    ) -> Admission:
        """The `Admission` needing the credits spent (the key's, its identity's): what the
        route costs."""
        spending = _waiting(admission, _SPEND, prepared.record, headers, None)
        spending.identity = prepared.identity
        if self.costs is not None:
            spending.cost = self.costs.cost(scope.get("method", ""), path)
        return spending

    async def complete(
        self, scope: Scope, path: str, required: Sequence[str], answer: Headers | Admission
    ) -> Headers:
        """The shell of `admit`: while `decide`'s `answer` is an `Admission`, load what it
        needs (the key from the store, the limiter's server's charge, the credits, their
        refund) and ask `decide` again; then its answer. What loading raises is handed to
        `decide`, which refuses with it."""
        while isinstance(answer, Admission):
            try:
                await self._load(answer)
            except Exception as exc:
                answer.failure = exc
            answer = self.decide(scope, path, required, answer)
        return answer

    async def _load(self, admission: Admission) -> None:
        need, record = admission.need, admission.record
        if need == _KEY:
            admission.record = await self.manager.verify(admission.token, record_usage=False)
        elif need == _LEGACY:
            manager = self.manager
            record = await manager.verify_imported(admission.token, record_usage=False)
            admission.record, admission.need = record, _KEY  # then on as any verified key
            manager.usage_buffer.count(record.id, LEGACY_SCHEME)
            if manager.telemetry.active:
                manager.telemetry.legacy_scheme(record.id)
        elif need == _CHARGE:
            charging, admission.charging = admission.charging, None
            assert charging is not None
            admission.charged = await charging
        elif need == _IDENTITY:
            assert record is not None
            assert record.identity is not None
            try:
                admission.identity = await self.manager.usable_identity(record.identity)
            except AuthenticationError:
                admission.record = None  # refused as its key would be by `verify`: uncounted
                raise
            admission.need = _KEY  # then on as a key whose identity is held
        elif need == _SPEND:
            assert record is not None
            manager, cost = self.manager, admission.cost
            admission.spent = await manager.spend_request_credits(record, admission.identity, cost)
        else:
            assert record is not None
            identity = admission.identity
            await self.limiter.refund(
                record.id,
                record.rate_limit,
                identity=None if identity is None else identity.id,
                identity_policies=None if identity is None else identity.rate_limit,
            )

    async def admit(self, scope: Scope, path: str, required: Sequence[str] = ()) -> Headers:
        """Admit the request `scope` to `path` (the path the app routes on), or refuse it:
        `decide`, and `complete` when it needs something loaded.

        `required` are scopes the key needs besides what the route table says (what an
        endpoint declares, say). Admitted: `scope["apikey"]` is the `KeyRecord`,
        `scope["auth"]` an `APIKeyAuth` and `scope["user"]` an `APIKeyUser`, and the answer
        is the `RateLimit` headers for the response. Refused: raises the
        `AuthenticationError` to answer with (its `headers` carry the `RateLimit` headers
        when the key got that far), counted as `refused` says; never anything else.
        """
        return await self.complete(scope, path, required, self.decide(scope, path, required))

    def _lacking(self, prepared: _Prepared, route: tuple[str, str]) -> tuple[str, ...] | None:
        """The scopes the route table says the key of `prepared` lacks for `route` (method,
        path), None when it may take it (or the gate has no table); remembered: what a
        route needs once per route, and the key's answer once per version."""
        lacking: tuple[str, ...] | None = None
        if self.scopes is not None:
            needed = self._needed(route)
            if needed is None:
                # No rule covers the route: only full access, unless the app allows it.
                if not (prepared.grants.full_access or self.allow_unmapped):
                    lacking = ()
            elif not prepared.grants.covers(needed):
                lacking = needed
        remember(prepared.routes, route, lacking, 256)  # a key on many paths (ids in them)
        return lacking

    def _needed(self, route: tuple[str, str]) -> tuple[str, ...] | None:
        """The scopes the route table says `route` needs (None: no rule covers it)."""
        assert self.scopes is not None
        try:
            return self._routes[route]
        except KeyError:
            return remember(self._routes, route, self.scopes.required(*route), 10_000)

    def _prepare(self, record: KeyRecord, admission: Admission | None) -> _Prepared:
        """What the core needs of this version of the key (see `_Prepared`).

        A key of an identity is prepared with the version of its identity the request is
        charged with (the one loaded, else the one held now), and kept apart: the core's
        one lookup by key id then costs a key of no identity nothing more, and sends a key
        of one here, where its identity is checked (`usable_identity_now`; the core asked
        `verify_now` to leave it). Raises `_Awaiting` the `Admission` needing the identity
        loaded when it is not held, and `_Uncounted` an identity's refusal (the request is
        not its key's: `verify` refuses it uncounted too)."""
        if record.identity is None:
            return self._made(record, None)
        identity = None if admission is None else admission.identity
        if identity is None or identity.id != record.identity:
            try:
                identity = self.manager.usable_identity_now(record.identity)
            except AuthenticationError as exc:
                raise _Uncounted(exc) from None
            if identity is None:
                raise _Awaiting(_waiting(admission, _IDENTITY, record, None, None))
        prepared = self._of_identities.get(record.id)
        if prepared is None or prepared.record is not record or prepared.identity is not identity:
            # Usable: `usable_identity_now` or the shell's `usable_identity` said so.
            prepared = self._made(record, identity)
        return prepared

    def _made(self, record: KeyRecord, identity: IdentityRecord | None) -> _Prepared:
        """`_Prepared` of this version of the key and of its `identity`'s (None: none),
        remembered."""
        grants = grants_for(record.scopes, record.access == "full")
        shared = self._by_grants.get(grants)
        if shared is None:
            shared = remember(self._by_grants, grants, (APIKeyAuth(grants), {}), _SHARED_GRANTS)
        auth, routes = shared
        limit = record.rate_limit
        if identity is None:
            shape = self._shapes.get(limit) or self._shape(limit)
            plan = self.limiter.plan(record.id, limit)
        else:
            its = identity.rate_limit
            shape = self._shapes.get((limit, its)) or self._shape(limit, its)
            plan = self.limiter.plan(record.id, limit, identity=identity.id, identity_policies=its)
        spends = record.credits is not None or spends_identity(record, identity)
        prepared = _Prepared(
            record, grants, auth, APIKeyUser(record), routes, plan, shape, spends, identity
        )
        if identity is None:
            return remember(self._prepared, record.id, prepared, 10_000)
        self._prepared.pop(record.id, None)  # a key moved into an identity
        return remember(self._of_identities, record.id, prepared, 10_000)

    def reads(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """True when `headers` carry a key this gate reads: its key header, and for
        Authorization one of its schemes (Bearer, its legacy ones); not `Basic`, `Token`…"""
        return self.reader.reads(headers)

    def refused(
        self,
        record: KeyRecord | None,
        exc: AuthenticationError,
        rate_headers: Headers | None = None,
    ) -> AuthenticationError:
        """Book the refusal `exc` of a request (of `record`, when its key was verified) and
        answer the error to send.

        A refusal of `REFUSED_AFTER_AUTHENTICATION` is counted in the key's usage history
        under its code (the key's request was counted when it was verified), and a rate
        limit or credits refusal in the limiter telemetry; other refusals (a bad key, 503)
        are the key's to nobody; a 503 is logged (`apikeys.outages`). The error's detail
        names the key's header, and its `headers` gain `rate_headers`.
        """
        if record is not None and exc.code in REFUSED_AFTER_AUTHENTICATION:
            self.manager.usage_buffer.refused(record.id, exc.code)
            if self.manager.telemetry.active and exc.code in _LIMITER_CODES:
                self.manager.telemetry.limiter(record.id, exc.code)
        if isinstance(exc, AuthUnavailable):
            self.outages.refused(exc)  # the store or the limiter failed: logged
        exc = self.reader.error(exc)
        if rate_headers:
            exc.headers = (*exc.headers, *rate_headers)
        return exc

    def _shape(self, limit: str | None, shared: str | None = None) -> OnePolicy | PolicySet:
        shape = shape_for(self.limiter, limit, self.policy_name, shared)
        return remember(self._shapes, limit if shared is None else (limit, shared), shape, 10_000)
