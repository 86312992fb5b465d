"""apikeys: production-grade API keys for any ASGI application.

Issue, hash, scope, rate-limit, disable, roll and revoke API keys, with a pure ASGI
middleware for Starlette, FastAPI or any ASGI app, on memory, SQLite, PostgreSQL or Redis.
"""

from __future__ import annotations

from apikeys.cache import KeyCache
from apikeys.errors import (
    APIKeyError,
    AuthenticationError,
    AuthUnavailable,
    ChangeNotConfirmed,
    ConfigurationError,
    CreditsExhausted,
    DeliveryInProgress,
    DuplicateIdentity,
    DuplicateKeyId,
    ForbiddenField,
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
    RateLimited,
    RequestRefused,
    SigningKeysUnavailable,
    StoreUnavailable,
    UnsupportedMediaType,
    WebhookTargetRefused,
)
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
    "RateDecision",
    "RateLimited",
    "RateLimiter",
    "RequestRefused",
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
