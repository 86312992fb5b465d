"""apikeys: production-grade API keys for any ASGI application.

Issue, hash, scope, rate-limit, disable, roll and revoke API keys, with a pure ASGI
middleware for Starlette, FastAPI or any ASGI app, on memory, SQLite, PostgreSQL or Redis.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The errors are imported at once: their module imports nothing of the package.
from apikeys.errors import (
    APIKeyError,
    AuthenticationError,
    AuthUnavailable,
    ChangeNotConfirmed,
    ConfigurationError,
    Conflict,
    CreditsExhausted,
    DeliveryInProgress,
    DuplicateIdentity,
    DuplicateKeyId,
    ForbiddenField,
    IdempotencyKeyReused,
    IdentityNotFound,
    InsufficientScope,
    InvalidAPIKey,
    InvalidKeyParameters,
    InvalidPayload,
    InvalidSignature,
    InvalidTransition,
    IPNotAllowed,
    KeyDisabled,
    KeyExpired,
    KeyNotFound,
    KeyRevoked,
    LimiterUnavailable,
    MalformedAPIKey,
    MalformedJSON,
    MethodNotAllowed,
    MissingAPIKey,
    MissingSignature,
    PayloadTooLarge,
    PreconditionFailed,
    RateLimited,
    RequestRefused,
    ResourceNotFound,
    SigningKeysUnavailable,
    StoreUnavailable,
    UnsupportedMediaType,
    WebhookTargetRefused,
)

if TYPE_CHECKING:
    from apikeys.cache import KeyCache
    from apikeys.hashing import Hasher, slow_context
    from apikeys.identities import IdentityRecord
    from apikeys.keys import ParsedKey, generate_key, parse_key
    from apikeys.lifecycle import check_usable
    from apikeys.listing import KeyFilter, KeyPage
    from apikeys.manager import KeyManager
    from apikeys.middleware import APIKeyAuth, APIKeyMiddleware, APIKeyUser, ScopeTable
    from apikeys.ratelimit import (
        Policy,
        PolicyDecision,
        PolicyStatus,
        RateDecision,
        RateLimiter,
        ThresholdCrossing,
        format_policies,
        parse_policies,
    )
    from apikeys.scopes import GrantedScopes
    from apikeys.stores import KeyStore, MemoryStore, register_store, store_from_url
    from apikeys.stores.contract import Channel, ChannelError, CreditSpend, IdentityStore
    from apikeys.sync import SyncKeyManager
    from apikeys.types import CreatedKey, KeyRecord, StoredKey, UsageDelta

__version__ = "0.1.0"

__all__ = [
    "APIKeyAuth",
    "APIKeyError",
    "APIKeyMiddleware",
    "APIKeyUser",
    "AuthUnavailable",
    "AuthenticationError",
    "ChangeNotConfirmed",
    "Channel",
    "ChannelError",
    "ConfigurationError",
    "Conflict",
    "CreatedKey",
    "CreditSpend",
    "CreditsExhausted",
    "DeliveryInProgress",
    "DuplicateIdentity",
    "DuplicateKeyId",
    "ForbiddenField",
    "GrantedScopes",
    "Hasher",
    "IPNotAllowed",
    "IdempotencyKeyReused",
    "IdentityNotFound",
    "IdentityRecord",
    "IdentityStore",
    "InsufficientScope",
    "InvalidAPIKey",
    "InvalidKeyParameters",
    "InvalidPayload",
    "InvalidSignature",
    "InvalidTransition",
    "KeyCache",
    "KeyDisabled",
    "KeyExpired",
    "KeyFilter",
    "KeyManager",
    "KeyNotFound",
    "KeyPage",
    "KeyRecord",
    "KeyRevoked",
    "KeyStore",
    "LimiterUnavailable",
    "MalformedAPIKey",
    "MalformedJSON",
    "MemoryStore",
    "MethodNotAllowed",
    "MissingAPIKey",
    "MissingSignature",
    "ParsedKey",
    "PayloadTooLarge",
    "Policy",
    "PolicyDecision",
    "PolicyStatus",
    "PreconditionFailed",
    "RateDecision",
    "RateLimited",
    "RateLimiter",
    "RequestRefused",
    "ResourceNotFound",
    "ScopeTable",
    "SigningKeysUnavailable",
    "StoreUnavailable",
    "StoredKey",
    "SyncKeyManager",
    "ThresholdCrossing",
    "UnsupportedMediaType",
    "UsageDelta",
    "WebhookTargetRefused",
    "__version__",
    "check_usable",
    "format_policies",
    "generate_key",
    "parse_key",
    "parse_policies",
    "register_store",
    "slow_context",
    "store_from_url",
]

# Where each name of `__all__` lives. A name is imported on first use (PEP 562), so a
# process that needs a part of the package does not load the rest: the `apikeys` command
# never loads the middleware, Starlette or the gate.
_HOMES: dict[str, tuple[str, ...]] = {
    "apikeys.cache": ("KeyCache",),
    "apikeys.hashing": ("Hasher", "slow_context"),
    "apikeys.identities": ("IdentityRecord",),
    "apikeys.keys": ("ParsedKey", "generate_key", "parse_key"),
    "apikeys.lifecycle": ("check_usable",),
    "apikeys.listing": ("KeyFilter", "KeyPage"),
    "apikeys.manager": ("KeyManager",),
    "apikeys.middleware": ("APIKeyAuth", "APIKeyMiddleware", "APIKeyUser", "ScopeTable"),
    "apikeys.ratelimit": (
        "Policy",
        "PolicyDecision",
        "PolicyStatus",
        "RateDecision",
        "RateLimiter",
        "ThresholdCrossing",
        "format_policies",
        "parse_policies",
    ),
    "apikeys.scopes": ("GrantedScopes",),
    "apikeys.stores": ("KeyStore", "MemoryStore", "register_store", "store_from_url"),
    "apikeys.stores.contract": ("Channel", "ChannelError", "CreditSpend", "IdentityStore"),
    "apikeys.sync": ("SyncKeyManager",),
    "apikeys.types": ("CreatedKey", "KeyRecord", "StoredKey", "UsageDelta"),
}
_HOME_OF: dict[str, str] = {name: module for module, names in _HOMES.items() for name in names}


# Defined for the interpreter only: to a type checker the names are the imports above, and
# a misspelt one stays an error.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        """A name of `__all__`, or a submodule (`apikeys.errors`), imported when first used."""
        module = _HOME_OF.get(name)
        if module is None:
            if name.startswith("_"):
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
            try:
                return importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":
                    raise
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
