"""apikeys in a Django project: a middleware, Django REST framework classes, a manager.

```python
# settings.py
INSTALLED_APPS = [
    # …
    "apikeys.integrations.django",  # system checks, `manage.py apikeys`, tables at migrate
]
MIDDLEWARE = [
    # …
    "apikeys.integrations.django.APIKeyMiddleware",
]
APIKEYS = {
    "PROTECT": "/api/",
    "SCOPES": {"GET /api/v1/contacts/{pk:int}/": "contacts:read"},
}
```

`APIKeyMiddleware` does what `apikeys.APIKeyMiddleware` does for an ASGI app, for Django
served over WSGI or ASGI (it is sync and async capable): requests under `PROTECT` need
`Authorization: Bearer <key>`; the key's address, rate limits, scopes (from the `SCOPES`
table) and credits are checked in the same order, every refusal is the same problem+json
response, admitted responses carry the `RateLimit` headers, and usage is counted alike.
It runs the ASGI middleware itself on each request, so the two cannot behave differently.
Views read `request.apikey` (the `KeyRecord`; `request.apikey.identity` is the id of the
identity the key belongs to, None for a key of none) and `request.apikey_auth` (its grants,
with `request.apikey_auth.scopes.covers([...])`), DRF views too. `manage.py apikeys
identities …` manages identities as the command line does. When Django loads it (the
server's start) the store is set up and the process's pepper checked against the store's:
another pepper, or none, stops the server with the store's message (`ConfigurationError`).

For Django REST framework (`pip install "apikeys[drf]"`):

```python
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["apikeys.integrations.django.APIKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["apikeys.integrations.django.HasScopes"],
    "EXCEPTION_HANDLER": "apikeys.integrations.django.exception_handler",
}


class ContactList(APIView):
    required_scopes = ["contacts:read"]  # or {"GET": [...], "POST": [...]}
```

`APIKeyAuthentication` authenticates the key (a request without one is anonymous, as DRF
expects, and `HasScopes` then refuses it with 401 `missing_api_key`; so is an Authorization
scheme it does not read, left to the view's other authentication classes); it checks the view's
`required_scopes` before it spends credits, in the middleware's order. A request the
middleware already admitted is not charged again. `exception_handler` answers refusals
with the middleware's exact problem+json responses; without it they keep their status,
body and `WWW-Authenticate` / `Retry-After` headers, rendered by DRF.

Settings: the `APIKEYS` dict, every entry optional. The store is `STORE_URL`, else the
`APIKEYS_STORE_URL` environment variable, else `sqlite:///apikeys.db`: the same store as the
`apikeys` command line. The pepper is `APIKEYS_PEPPER` (and `APIKEYS_OLD_PEPPERS`), as for
the command line, unless `PEPPER` is set. The other entries are the ASGI middleware's
arguments in capitals: `PROTECT` (default `"/"`), `PUBLIC`, `SCOPES`, `UNMAPPED`, `COSTS`,
`RATE_LIMIT` (else `APIKEYS_RATE_LIMIT`), `LIMITER_URL` (else `APIKEYS_LIMITER_URL`, else
`memory://`), `REALM`, `POLICY_NAME`, `HEADER`, `TRUSTED_PROXIES`; `STORE_OPTIONS` and
`MANAGER_OPTIONS`, keyword arguments for `store_from_url` and `KeyManager`;
`CORS_PREFLIGHT`: whether CORS preflights pass without a key (`"auto"`, the default: when
django-cors-headers' middleware is installed, which answers them; True; False); and
`LEGACY_SCHEMES` (e.g. `["Api-Key"]` while a migration from djangorestframework-api-key
lasts: docs/migrating.md). A DRF view's `required_scopes` are its route's rule where
`SCOPES` has none.

`get_manager()` is the process's `apikeys.sync.KeyManager` on that store, for views and
management commands: `get_manager().create(name=…, scopes=[…])`. Everything runs on its
event loop, in a thread of its own (see `apikeys.sync`); it is closed, and its usage counts
written, at interpreter exit. `async_manager()` is a new asynchronous manager on the same
store and pepper, for ASGI code on the server's loop (the settings page).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import re
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

try:
    from asgiref.sync import iscoroutinefunction, markcoroutinefunction
    from django.conf import settings as django_settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.signals import setting_changed
    from django.http import HttpRequest, HttpResponse
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installed extras
    raise ModuleNotFoundError(
        "apikeys.integrations.django needs Django. Install it with: pip install 'apikeys[django]'",
        name=exc.name,
    ) from None

from apikeys.errors import (
    AuthenticationError,
    ConfigurationError,
    InsufficientScope,
    StoreUnavailable,
)
from apikeys.gate import Gate
from apikeys.hashing import Hasher
from apikeys.integrations.django.routing import check_syntax, drf_routes, probe
from apikeys.manager import KeyManager as AsyncKeyManager
from apikeys.middleware import APIKeyAuth
from apikeys.middleware import APIKeyMiddleware as ASGIMiddleware
from apikeys.problems import check_realm, encode_problem
from apikeys.ratelimit import RateLimiter
from apikeys.routes import CostTable, ScopeTable
from apikeys.scopes import GrantedScopes
from apikeys.stores.contract import KeyStore
from apikeys.stores.registry import store_from_url
from apikeys.sync import KeyManager
from apikeys.types import KeyRecord, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from apikeys.integrations.django.drf import (
        APIKeyAuthentication,
        APIKeyRefused,
        HasScopes,
        exception_handler,
    )

__all__ = [
    "DEFAULT_STORE_URL",
    "APIKeyAuthentication",
    "APIKeyMiddleware",
    "APIKeyRefused",
    "HasScopes",
    "Outcome",
    "Refusal",
    "apikeys_settings",
    "async_manager",
    "check_request",
    "current_realm",
    "exception_handler",
    "get_manager",
    "required_scopes",
    "reset",
]

logger = logging.getLogger("apikeys")

DEFAULT_STORE_URL = "sqlite:///apikeys.db"
"""The store when neither `APIKEYS["STORE_URL"]` nor `APIKEYS_STORE_URL` names one (the
command line's default)."""

_DEFAULTS: dict[str, Any] = {
    "STORE_URL": None,
    "STORE_OPTIONS": {},
    "MANAGER_OPTIONS": {},
    "PEPPER": None,
    "PROTECT": "/",
    "PUBLIC": (),
    "SCOPES": None,
    "UNMAPPED": "deny",
    "COSTS": None,
    "RATE_LIMIT": None,
    "LIMITER_URL": None,
    "REALM": "api",
    "POLICY_NAME": "default",
    "HEADER": "Authorization",
    "TRUSTED_PROXIES": 0,
    "CORS_PREFLIGHT": "auto",
    "LEGACY_SCHEMES": (),
}
_DRF_NAMES = frozenset({"APIKeyAuthentication", "APIKeyRefused", "HasScopes", "exception_handler"})
# Where the request's key, grants and RateLimit headers are kept on a Django request.
_RECORD, _AUTH, _HEADERS = "apikey", "apikey_auth", "_apikeys_headers"


# What each setting takes (None where its default is None): checked before any is used, so
# a value of the wrong kind names its setting, never a TypeError from deep inside.
_TEXTS = (str, list, tuple)
_KINDS: dict[str, tuple[type, ...]] = {
    "STORE_URL": (str, type(None)),
    "STORE_OPTIONS": (Mapping,),
    "MANAGER_OPTIONS": (Mapping,),
    "PROTECT": _TEXTS,
    "PUBLIC": (list, tuple),
    "SCOPES": (Mapping, type(None)),
    "UNMAPPED": (str,),
    "COSTS": (Mapping, type(None)),
    "RATE_LIMIT": (str, Mapping, type(None)),
    "LIMITER_URL": (str, type(None)),
    "REALM": (str,),
    "POLICY_NAME": (str,),
    "HEADER": (str,),
    "TRUSTED_PROXIES": (int,),
    "LEGACY_SCHEMES": (list, tuple),
}
_OF_TEXTS = ("PROTECT", "PUBLIC", "LEGACY_SCHEMES")


def _check_kinds(config: Mapping[str, Any]) -> None:
    for name, kinds in _KINDS.items():
        value = config[name]
        wrong = not isinstance(value, kinds) or isinstance(value, bool)
        if name in _OF_TEXTS and not isinstance(value, str) and not wrong:
            wrong = not all(isinstance(item, str) for item in value)
        if wrong:
            raise ConfigurationError(
                f"APIKEYS[{name!r}] takes {' or '.join(k.__name__ for k in kinds)}"
                f"{' (of strings)' if name in _OF_TEXTS else ''}, not {type(value).__name__}"
            )


def apikeys_settings() -> dict[str, Any]:
    """`settings.APIKEYS` with the defaults of every key it leaves out; an unknown key or a
    value of the wrong kind raises `ConfigurationError`."""
    given = getattr(django_settings, "APIKEYS", None) or {}
    if not isinstance(given, Mapping):
        raise ConfigurationError("settings.APIKEYS must be a dict")
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        known = ", ".join(sorted(_DEFAULTS))
        raise ConfigurationError(f"unknown APIKEYS setting(s) {unknown} (known: {known})")
    config = {**_DEFAULTS, **given}
    config["STORE_URL"] = (
        config["STORE_URL"] or os.environ.get("APIKEYS_STORE_URL") or DEFAULT_STORE_URL
    )
    config["LIMITER_URL"] = (
        config["LIMITER_URL"] or os.environ.get("APIKEYS_LIMITER_URL") or "memory://"
    )
    _check_kinds(config)
    check_syntax(config["SCOPES"], "scope")
    check_syntax(config["COSTS"], "cost")
    if config["CORS_PREFLIGHT"] not in ("auto", True, False):
        raise ConfigurationError('APIKEYS["CORS_PREFLIGHT"] takes "auto", True or False')
    return config


_CORS_MIDDLEWARE = "corsheaders.middleware.CorsMiddleware"
_OUR_MIDDLEWARE = "apikeys.integrations.django.APIKeyMiddleware"


def _preflight_paths(config: Mapping[str, Any]) -> re.Pattern[str] | None:
    """The paths whose CORS preflights pass without a key (`re.match`), None for none:
    `CORS_PREFLIGHT`, where `"auto"` means those django-cors-headers' middleware answers
    itself, before any view (its `CORS_URLS_REGEX`, every path by default), when it is
    installed right after ours (or before it)."""
    chosen = config["CORS_PREFLIGHT"]
    if chosen == "auto":
        # Only when django-cors-headers' middleware is the next one after ours (or before
        # it): a middleware in between would run for a request without a key.
        listed = list(getattr(django_settings, "MIDDLEWARE", None) or ())
        if _CORS_MIDDLEWARE not in listed:
            return None
        cors = listed.index(_CORS_MIDDLEWARE)
        ours = listed.index(_OUR_MIDDLEWARE) if _OUR_MIDDLEWARE in listed else cors
        if cors > ours + 1:
            return None
        return re.compile(getattr(django_settings, "CORS_URLS_REGEX", r"^.*$"))
    return re.compile("") if chosen else None


@dataclass
class Refusal:
    """A refused request: the problem+json response the ASGI middleware sent."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def response(self) -> HttpResponse:
        """As a Django response, byte for byte."""
        response = HttpResponse(self.body, status=self.status)
        for name, value in self.headers:
            response.headers[name.decode("latin-1")] = value.decode("latin-1")
        return response

    @classmethod
    def of(cls, exc: AuthenticationError, realm: str) -> Refusal:
        """The refusal `exc` stands for, encoded as the middleware encodes it."""
        headers, body = encode_problem(exc, realm)
        return cls(exc.status, headers, body)


@dataclass
class Outcome:
    """What the ASGI middleware made of a request: passed on (with a key, or on a path it
    does not protect), or refused."""

    passed: bool = False
    record: KeyRecord | None = None
    auth: APIKeyAuth | None = None
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)

    def refusal(self) -> Refusal:
        """The response the middleware refused the request with."""
        return Refusal(self.status, self.headers, bytes(self.body))


_PASSED = "apikeys.django.passed"


async def _admit(scope: Scope, receive: Receive, send: Send) -> None:
    """The application behind the ASGI middleware: notes that the request got through, and
    starts a response so that the middleware adds its RateLimit headers."""
    scope[_PASSED] = True
    await send({"type": "http.response.start", "status": 200, "headers": []})


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


class _Runtime:
    """The process's manager, limiter and ASGI middlewares, made from the settings."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.realm: str = check_realm(config["REALM"])
        # Rules that cannot be understood are refused now, not at the first request.
        ScopeTable(config["SCOPES"])
        CostTable(config["COSTS"])
        store, options = _manager_arguments(config)
        self.manager = KeyManager(store, **options)
        try:
            _set_up(self.manager)
            self.limiter = self.manager.loop_thread.call(
                _limiter, config["RATE_LIMIT"], config["LIMITER_URL"]
            )
        except BaseException:
            self.manager.close()
            raise
        self._engines: _Engines | None = None
        self.pid = os.getpid()
        # Closed at exit before the manager's own last resort (registered after it).
        atexit.register(self.close)
        self._lock = threading.Lock()
        # The middlewares DRF views use, by the scopes they require.
        self._by_scopes: dict[tuple[str, ...], ASGIMiddleware] = {}

    @property
    def engines(self) -> _Engines:
        """The ASGI middlewares requests go through, made on first use (they read the
        URLconf, which may itself ask for the manager while it is imported)."""
        engines = self._engines
        if engines is None:
            with self._lock:
                engines = self._engines
                if engines is None:
                    engines = self._engines = self._build()
        return engines

    def forget_routes(self) -> None:
        """Make the middlewares afresh at the next request (the URLconf changed), on the
        same manager and store."""
        with self._lock:
            self._engines = None

    @property
    def middleware(self) -> ASGIMiddleware:
        """The middleware of requests to routes no DRF view of apikeys serves."""
        return self.engines.default

    def _build(self) -> _Engines:
        config = self.config
        explicit, rules = config["SCOPES"] or {}, config["SCOPES"]
        routes = drf_routes()
        if routes:
            table = ScopeTable(explicit)
            # A DRF view's required_scopes are its route's rule, where SCOPES has none.
            derived = {
                rule: list(required)
                for route in routes
                for rule, required in route.rules().items()
                if not any(table.required(*_split(rule, path)) for path in probe(route.path))
            }
            rules = {**derived, **explicit}
        options = {"protect": config["PROTECT"], "public": config["PUBLIC"], "scopes": rules}
        default = self._engine(unmapped=config["UNMAPPED"], **options)
        if not routes:
            return _Engines(default, default, None, _preflight_paths(config))
        # Methods a DRF view requires no scope for are left to the view (any key).
        drf = ScopeTable({f"* {route.path}": "apikeys:drf" for route in routes})
        return _Engines(
            default, self._engine(unmapped="allow", **options), drf, _preflight_paths(config)
        )

    def _engine(self, **options: Any) -> ASGIMiddleware:
        config = self.config
        return ASGIMiddleware(
            _admit,
            manager=self.manager.manager,
            limiter=self.limiter,
            realm=config["REALM"],
            policy_name=config["POLICY_NAME"],
            header=config["HEADER"],
            trusted_proxies=config["TRUSTED_PROXIES"],
            costs=config["COSTS"],
            legacy_schemes=config["LEGACY_SCHEMES"],
            **options,
        )

    def for_scopes(self, required: tuple[str, ...]) -> ASGIMiddleware:
        """The middleware that checks a DRF view's keys: every path, these scopes."""
        found = self._by_scopes.get(required)
        if found is None:
            with self._lock:
                found = self._by_scopes.get(required)
                if found is None:
                    rules = {"* /{path:path}": list(required)} if required else None
                    found = self._by_scopes[required] = self._engine(
                        scopes=rules, protect="/", unmapped="allow"
                    )
        return found

    def close(self) -> None:
        atexit.unregister(self.close)
        try:
            if self.manager.loop_thread.running:
                self.manager.loop_thread.call(self.limiter.aclose)
        finally:
            self.manager.close()


def _manager_arguments(config: Mapping[str, Any]) -> tuple[KeyStore, dict[str, Any]]:
    """The store and the `KeyManager` options the settings name."""
    options = dict(config["MANAGER_OPTIONS"])
    taken = inspect.signature(AsyncKeyManager).parameters
    unknown = sorted(str(name) for name in options if name not in taken or name == "store")
    if unknown:
        raise ConfigurationError(f'APIKEYS["MANAGER_OPTIONS"]: KeyManager takes no {unknown}')
    if config["PEPPER"] is not None:
        options["hasher"] = Hasher(pepper=config["PEPPER"])
    try:
        store = store_from_url(config["STORE_URL"], **config["STORE_OPTIONS"])
    except TypeError as exc:  # an option the URL's store does not take
        raise ConfigurationError(f'APIKEYS["STORE_OPTIONS"]: {exc}') from None
    return store, options


def async_manager() -> AsyncKeyManager:
    """A new asynchronous `KeyManager` on the store and pepper of the settings, for ASGI
    code that runs on the server's event loop, such as the settings page
    (`apikeys.ui.KeysPage`): `get_manager()`'s runs on an event loop of its own, whose
    connections no other loop may use. Enter it (`async with`) in the app's lifespan."""
    store, options = _manager_arguments(apikeys_settings())
    return AsyncKeyManager(store, **options)


def _split(rule: str, path: str) -> tuple[str, str]:
    return rule.partition(" ")[0], path


@dataclass(frozen=True)
class _Engines:
    """The ASGI middlewares of a runtime: `default`, and `drf` (with `unmapped="allow"`)
    for the routes of the DRF views in the table `drf_routes`; the paths whose CORS
    preflights pass without a key."""

    default: ASGIMiddleware
    drf: ASGIMiddleware
    drf_routes: ScopeTable | None
    preflights: re.Pattern[str] | None

    def pick(self, request: HttpRequest) -> ASGIMiddleware | None:
        """The middleware that checks `request`; None for a CORS preflight let through."""
        method = request.method or "GET"
        if (
            method == "OPTIONS"
            and self.preflights is not None
            and "origin" in request.headers
            and "access-control-request-method" in request.headers
            and self.preflights.match(request.path_info)
        ):
            return None
        routes = self.drf_routes
        if routes is not None and routes.required(method, request.path_info) is not None:
            return self.drf
        return self.default


def _set_up(manager: KeyManager) -> None:
    """Prepare the store and check the process's pepper against it, as `async with
    manager` does: a pepper other than the store's raises `ConfigurationError` (the store's
    fingerprint message) rather than every key answering 401. A store out of reach is
    logged; its requests answer 503 until it is back."""
    try:
        manager.setup()
    except StoreUnavailable as exc:
        logger.warning("apikeys: the pepper was not checked: %s", exc.operator_text or exc)


async def _refused(gate: Gate, record: KeyRecord, exc: AuthenticationError) -> AuthenticationError:
    """`gate.refused`, on the manager's loop (where the usage counts are kept)."""
    return gate.refused(record, exc)


async def _limiter(rate_limit: str | None, url: str) -> RateLimiter:
    return RateLimiter(rate_limit, url)


async def _check(middleware: ASGIMiddleware, scope: Scope) -> Outcome:
    """Run `middleware` on the request `scope`; what it decided."""
    outcome = Outcome()

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            outcome.status = message["status"]
            outcome.headers = list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            outcome.body += message.get("body", b"")

    await middleware(scope, _no_body, send)
    if scope.get(_PASSED):
        outcome.passed = True
        outcome.record = scope.get("apikey")
        outcome.auth = scope.get("auth")
    return outcome


_runtime_lock = threading.Lock()
_current: _Runtime | None = None


def _runtime() -> _Runtime:
    global _current
    runtime = _current
    if runtime is None or runtime.pid != os.getpid():
        with _runtime_lock:
            runtime = _current
            # One made before a pre-forking server forked has no loop thread in this process.
            if runtime is None or runtime.pid != os.getpid():
                runtime = _current = _Runtime(apikeys_settings())
    return runtime


def current_realm() -> str:
    """The realm of the `REALM` setting, which refusals and challenges name."""
    return _runtime().realm


def get_manager() -> KeyManager:
    """The process's synchronous `KeyManager`, on the store the settings name (made on first
    use; the middleware and the DRF classes use the same one)."""
    return _runtime().manager


def reset() -> None:
    """Close the process's manager and limiter; the next request makes them afresh from the
    settings. Done when `settings.APIKEYS` changes (`override_settings` in tests); at
    interpreter exit they are closed the same way."""
    global _current
    with _runtime_lock:
        runtime, _current = _current, None
    if runtime is not None:
        runtime.close()


# Settings the middlewares are made from, besides APIKEYS: the routes and the CORS layer.
_ROUTING_SETTINGS = frozenset({"ROOT_URLCONF", "MIDDLEWARE", "CORS_URLS_REGEX"})


def _on_setting_changed(*, setting: str, **_: Any) -> None:
    if setting == "APIKEYS":
        reset()
    elif setting in _ROUTING_SETTINGS:
        runtime = _current
        if runtime is not None:
            runtime.forget_routes()


setting_changed.connect(_on_setting_changed, dispatch_uid="apikeys.integrations.django")


def _scope_of(request: HttpRequest) -> Scope:
    """The ASGI scope the middleware reads, for a Django request (WSGI or ASGI)."""
    asgi = getattr(request, "scope", None)
    if isinstance(asgi, dict):
        scope: Scope = dict(asgi)
    else:
        meta = request.META
        remote = meta.get("REMOTE_ADDR")
        scope = {
            "type": "http",
            "headers": [
                (name[5:].replace("_", "-").lower().encode("latin-1"), value.encode("latin-1"))
                for name, value in meta.items()
                if name.startswith("HTTP_") and isinstance(value, str) and value.isascii()
            ],
            "client": (remote, 0) if remote else None,
        }
    # Django routes on path_info (the path without the script name): so does the middleware.
    scope.update(method=request.method or "GET", path=request.path_info, root_path="")
    return scope


def _add_headers(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    for name, value in getattr(request, _HEADERS, ()):
        response.headers[name.decode("latin-1")] = value.decode("latin-1")
    return response


class APIKeyMiddleware:
    """Django middleware: authenticate requests under `APIKEYS["PROTECT"]` with API keys.

    Sync and async capable. An admitted request reaches the view with `request.apikey` (the
    `KeyRecord`) and `request.apikey_auth` (`.scopes` understands `resource:*` and full
    access); a refused one never does: the client gets the problem+json response. It also
    adds the `RateLimit` headers that `APIKeyAuthentication` noted to DRF's responses.
    """

    sync_capable = True
    async_capable = True

    def __init__(
        self,
        get_response: Callable[[HttpRequest], HttpResponse | Awaitable[HttpResponse]],
    ) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
        # At start, when Django loads its middleware: a pepper other than the store's
        # stops the server here with the store's message, not a 401 to every key.
        _runtime()

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        runtime = _runtime()
        middleware = runtime.engines.pick(request)
        if middleware is None:
            return self.get_response(request)
        outcome = runtime.manager.loop_thread.call(_check, middleware, _scope_of(request))
        if not outcome.passed:
            return outcome.refusal().response()
        self._admitted(request, outcome)
        response = self.get_response(request)
        return _add_headers(request, response)

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        runtime = _runtime()
        middleware = runtime.engines.pick(request)
        if middleware is None:
            return await self.get_response(request)
        outcome = await runtime.manager.loop_thread.acall(_check, middleware, _scope_of(request))
        if not outcome.passed:
            return outcome.refusal().response()
        self._admitted(request, outcome)
        response = await self.get_response(request)
        return _add_headers(request, response)

    @staticmethod
    def _admitted(request: HttpRequest, outcome: Outcome) -> None:
        if outcome.record is not None:
            setattr(request, _RECORD, outcome.record)
            setattr(request, _AUTH, outcome.auth)
            setattr(request, _HEADERS, outcome.headers)


def required_scopes(view: Any, method: str) -> tuple[str, ...] | None:
    """The scopes `view` declares for `method` in its `required_scopes` (a list, or a dict
    by method with `*` for the others); None when it declares none."""
    declared = getattr(view, "required_scopes", None)
    if declared is None:
        return None
    if isinstance(declared, Mapping):
        declared = declared.get(method.upper(), declared.get("*", ()))
    if isinstance(declared, str):
        return (declared,)
    if not isinstance(declared, Sequence):
        raise ImproperlyConfigured(
            f"{type(view).__name__}.required_scopes must be a list of scopes, or a dict of "
            "lists by HTTP method"
        )
    return tuple(declared)


def check_request(request: HttpRequest, required: tuple[str, ...]) -> Outcome | None:
    """The outcome of the key of `request`, checked for the scopes `required` (what the DRF
    classes do for a view's `required_scopes`); None when the request carries no key
    (anonymous), or carries Authorization under a scheme the gate does not read (another
    authentication class's). A request the middleware admitted is not charged again: only
    its scopes are checked."""
    record = getattr(request, _RECORD, None)
    runtime = _runtime()
    if record is not None:
        auth: APIKeyAuth = getattr(request, _AUTH)
        if required and not cast("GrantedScopes", auth.scopes).covers(required):
            error = runtime.manager.loop_thread.call(
                _refused, runtime.middleware.gate, record, InsufficientScope(required)
            )
            refusal = Refusal.of(error, runtime.realm)
            return Outcome(
                False, record, auth, refusal.status, refusal.headers, bytearray(refusal.body)
            )
        return Outcome(True, record, auth)
    scope = _scope_of(request)
    if not runtime.middleware.gate.reads(scope["headers"]):
        return None
    outcome = runtime.manager.loop_thread.call(_check, runtime.for_scopes(required), scope)
    if outcome.passed and outcome.record is not None:
        setattr(request, _RECORD, outcome.record)
        setattr(request, _AUTH, outcome.auth)
        setattr(request, _HEADERS, outcome.headers)
    return outcome


def __getattr__(name: str) -> Any:
    """The DRF classes, imported when first asked for (they need Django REST framework)."""
    if name in _DRF_NAMES:
        from apikeys.integrations.django import drf

        return getattr(drf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
