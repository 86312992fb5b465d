"""Every exception apikeys raises, in one tree.

```
APIKeyError                       root of everything apikeys raises
├── ConfigurationError            bad settings: unknown store scheme, missing extra, bad pepper
├── InvalidKeyParameters          bad arguments to create / roll (scope, rate limit, expiry)
├── KeyNotFound                   a management call named an id the store does not hold
│   └── IdentityNotFound          … an identity's id
├── InvalidTransition             a state change the key's state forbids (enable a revoked key)
├── DuplicateKeyId                a store refused an id it already holds
│   └── DuplicateIdentity         … an identity's id
├── DeliveryInProgress            a webhook delivery cannot be replayed while it is being sent
├── WebhookTargetRefused          a webhook URL is, or resolves to, an internal address
└── RequestRefused                an HTTP request is refused; carries `status` and `code`
    ├── AuthenticationError       a request may not pass with its key
    │   ├── MissingAPIKey         401 missing_api_key
    │   ├── MalformedAPIKey       401 malformed_api_key
    │   ├── InvalidAPIKey         401 invalid_api_key
    │   ├── KeyDisabled           401 key_disabled
    │   ├── KeyRevoked            401 key_revoked
    │   ├── KeyExpired            401 key_expired
    │   ├── InsufficientScope     403 insufficient_scope
    │   ├── IPNotAllowed          403 ip_not_allowed
    │   ├── RateLimited           429 rate_limited
    │   ├── CreditsExhausted      429 credits_exhausted
    │   └── AuthUnavailable       503 auth_unavailable (fail closed)
    │       ├── StoreUnavailable      the key store could not be reached
    │       │   └── ChangeNotConfirmed  a change committed, its replication not confirmed
    │       └── LimiterUnavailable    the rate-limit storage could not be reached
    ├── MissingSignature          401 missing_signature (leak endpoints: no GitHub signature)
    ├── InvalidSignature          401 invalid_signature
    ├── MethodNotAllowed          405 method_not_allowed
    ├── PayloadTooLarge           413 payload_too_large
    ├── UnsupportedMediaType      415 unsupported_media_type
    ├── MalformedJSON             400 malformed_json
    ├── InvalidPayload            400 invalid_payload (with `errors`, a list of field errors)
    ├── ForbiddenField            403 forbidden_field (a workspace user set an operator's field)
    ├── ResourceNotFound          404 not_found (a management call named an id it cannot see)
    ├── Conflict                  409 conflict (a state the key or identity is in forbids it)
    ├── PreconditionFailed        412 precondition_failed (`If-Match` names another version)
    ├── IdempotencyKeyReused      422 idempotency_key_reused (the key came with another body)
    └── SigningKeysUnavailable    503 signing_keys_unavailable (GitHub's key list unreachable)
```

`apikeys.problems` is the one place that turns a `RequestRefused` into an
`application/problem+json` response. No message here ever includes a secret: errors are
built from key ids, scope names and numbers only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "APIKeyError",
    "AuthUnavailable",
    "AuthenticationError",
    "ChangeNotConfirmed",
    "ConfigurationError",
    "Conflict",
    "CreditsExhausted",
    "DeliveryInProgress",
    "DuplicateIdentity",
    "DuplicateKeyId",
    "ForbiddenField",
    "IPNotAllowed",
    "IdempotencyKeyReused",
    "IdentityNotFound",
    "InsufficientScope",
    "InvalidAPIKey",
    "InvalidKeyParameters",
    "InvalidPayload",
    "InvalidSignature",
    "InvalidTransition",
    "KeyDisabled",
    "KeyExpired",
    "KeyNotFound",
    "KeyRevoked",
    "LimiterUnavailable",
    "MalformedAPIKey",
    "MalformedJSON",
    "MethodNotAllowed",
    "MissingAPIKey",
    "MissingSignature",
    "PayloadTooLarge",
    "PreconditionFailed",
    "RateLimited",
    "RequestRefused",
    "ResourceNotFound",
    "SigningKeysUnavailable",
    "StoreUnavailable",
    "UnsupportedMediaType",
    "WebhookTargetRefused",
]


class APIKeyError(Exception):
    """Root of every exception raised by apikeys."""


class ConfigurationError(APIKeyError):
    """apikeys was configured with something it cannot use."""


class InvalidKeyParameters(APIKeyError, ValueError):
    """An argument to `KeyManager.create` or `roll` is not acceptable."""


class KeyNotFound(APIKeyError, LookupError):
    """No key with this id exists in the store."""

    def __init__(self, key_id: str) -> None:
        super().__init__(f"no API key with id {key_id!r}")
        self.key_id = key_id


class IdentityNotFound(KeyNotFound):
    """No identity with this id exists in the store (or in the workspace asked about)."""

    def __init__(self, identity_id: str, why: str | None = None) -> None:
        APIKeyError.__init__(self, why or f"no identity with id {identity_id!r}")
        self.key_id = identity_id


class InvalidTransition(APIKeyError):
    """The key's (or identity's) current state does not allow the requested change."""

    def __init__(
        self,
        key_id: str,
        status: str,
        action: str,
        why: str | None = None,
        *,
        subject: str = "API key",
    ) -> None:
        super().__init__(f"cannot {action} {subject} {key_id!r}: {why or f'it is {status}'}")
        self.key_id = key_id
        self.status = status
        self.action = action
        self.why = why or f"it is {status}"


class DuplicateKeyId(APIKeyError):
    """The store already holds a key with this id."""


class DuplicateIdentity(DuplicateKeyId):
    """The store already holds an identity with this id."""

    def __init__(self, identity_id: str) -> None:
        super().__init__(f"an identity with id {identity_id!r} exists already")
        self.identity_id = identity_id


class DeliveryInProgress(APIKeyError):
    """A webhook delivery was asked to be replayed while a process is sending it (it holds
    its lease): replaying it then would let a second process send it at the same time.
    Replay it once that attempt has ended."""

    def __init__(self, delivery_id: str) -> None:
        super().__init__(
            f"delivery {delivery_id!r} is being sent now: replay it once this attempt has "
            "ended (within the lease of the process sending it, 60 seconds by default)"
        )
        self.delivery_id = delivery_id


class WebhookTargetRefused(APIKeyError):
    """A webhook endpoint's host is, or resolves to, a loopback, private, link-local or
    other internal address, and internal targets are not allowed
    (`apikeys.webhooks.targets`). `apikeys webhooks add` exits with status 1."""

    status = 400
    code = "webhook_target_refused"

    def __init__(self, host: str) -> None:
        super().__init__(
            f"refused: internal address: the webhook host {host!r} is, or resolves to, a "
            "loopback, private, link-local or other internal address (set "
            "APIKEYS_WEBHOOKS_ALLOW_PRIVATE=1 to allow internal receivers)"
        )
        self.host = host


class RequestRefused(APIKeyError):
    """An HTTP request is refused. Subclasses fix the HTTP status, code and title."""

    status: int = 400
    code: str = "bad_request"
    title: str = "Bad request"
    detail: str = "The request cannot be handled."
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """Extra response headers that belong with this refusal (e.g. `RateLimit`)."""

    def __init__(self, detail: str | None = None) -> None:
        if detail is not None:
            self.detail = detail
        super().__init__(self.detail)


class AuthenticationError(RequestRefused):
    """A request may not pass with its key (or without one)."""

    status: int = 401
    code: str = "invalid_api_key"
    title: str = "Invalid API key"
    detail: str = "The API key is not valid."


class MissingAPIKey(AuthenticationError):
    """No `Authorization` header was sent."""

    code = "missing_api_key"
    title = "Missing API key"
    detail = "Send the API key in the Authorization header as 'Bearer <key>'."


class MalformedAPIKey(AuthenticationError):
    """The header is not `Bearer <key>`, or the token is not in the key format."""

    code = "malformed_api_key"
    title = "Malformed API key"
    detail = "The Authorization header is not 'Bearer <key>' with a well-formed API key."


class InvalidAPIKey(AuthenticationError):
    """The token is well-formed, but no key has this id, or the secret is wrong."""

    code = "invalid_api_key"
    title = "Invalid API key"
    detail = "The API key is not valid."


class KeyDisabled(AuthenticationError):
    """The secret is right, but the key is disabled."""

    code = "key_disabled"
    title = "API key disabled"
    detail = "The API key is disabled."


class KeyRevoked(AuthenticationError):
    """The secret is right, but the key was revoked (for good)."""

    code = "key_revoked"
    title = "API key revoked"
    detail = "The API key was revoked. Create a new key to regain access."


class KeyExpired(AuthenticationError):
    """The secret is right, but the key's `expires_at` has passed (or its roll grace ended)."""

    code = "key_expired"
    title = "API key expired"
    detail = "The API key has expired."


class InsufficientScope(AuthenticationError):
    """The key is usable but lacks a scope the operation requires (`required_scopes`)."""

    status = 403
    code = "insufficient_scope"
    title = "Insufficient scope"

    def __init__(self, required_scopes: Sequence[str]) -> None:
        self.required_scopes = tuple(required_scopes)
        if not self.required_scopes:
            # A protected route that no scope rule covers: closed to restricted keys.
            super().__init__("No scope rule covers this operation: it needs a full-access key.")
            return
        super().__init__(
            "The API key lacks the scope this operation requires: "
            + ", ".join(self.required_scopes)
            + "."
        )


class RateLimited(AuthenticationError):
    """The key's rate limit is exhausted; `retry_after` is the whole seconds to wait.

    `violated_policies` names the key's policies that refused the request (`default` for a
    key with one limit).
    """

    status = 429
    code = "rate_limited"
    title = "Rate limit exceeded"

    def __init__(self, retry_after: int, violated_policies: Sequence[str] = ("default",)) -> None:
        self.retry_after = max(1, int(retry_after))
        self.violated_policies = tuple(violated_policies)
        super().__init__(
            f"The API key's rate limit is exhausted; retry in {self.retry_after} seconds."
        )


class IPNotAllowed(AuthenticationError):
    """The request comes from an address outside the key's allowlist."""

    status = 403
    code = "ip_not_allowed"
    title = "Address not allowed"
    detail = "This API key may not be used from this address."


class CreditsExhausted(AuthenticationError):
    """The key's credits are used up; `retry_after` is the whole seconds to the next refill,
    or None when the key has no refill."""

    status = 429
    code = "credits_exhausted"
    title = "Credits exhausted"

    def __init__(self, retry_after: int | None = None) -> None:
        self.retry_after = None if retry_after is None else max(1, int(retry_after))
        if self.retry_after is None:
            super().__init__("The API key's credits are used up.")
        else:
            super().__init__(
                "The API key's credits are used up; they are refilled in "
                f"{self.retry_after} seconds."
            )


class AuthUnavailable(AuthenticationError):
    """The key store or the limiter could not be reached; requests fail closed."""

    status = 503
    code = "auth_unavailable"
    title = "Authentication unavailable"
    detail = "API keys cannot be checked right now. Retry shortly."
    retry_after = 1

    def __init__(self, original: BaseException | None = None, *, hint: str | None = None) -> None:
        self.original = original
        self.hint = hint
        super().__init__()

    def __str__(self) -> str:
        text = self.detail
        if self.original is not None:
            text = f"{text} ({type(self.original).__name__})"
        return f"{text} {self.hint[:1].upper()}{self.hint[1:]}." if self.hint else text


class StoreUnavailable(AuthUnavailable):
    """The key store raised a connection or timeout error; `original` holds it, and `hint`
    what to do about it when apikeys knows (a pooler needs `?prepared_statements=false`
    in the store URL, say). Neither is ever sent to the client.

    Raised when a manager starts (`async with manager`), it also carries `operator_text`,
    which `str()` then gives: the store (password masked) and the cause, for the log.
    Clients still get only `detail`.
    """

    def __init__(
        self,
        original: BaseException | None = None,
        *,
        hint: str | None = None,
        operator_text: str | None = None,
    ) -> None:
        self.operator_text = operator_text
        super().__init__(original, hint=hint)

    def __str__(self) -> str:
        return self.operator_text or super().__str__()


class ChangeNotConfirmed(StoreUnavailable):
    """A change was committed on the store's primary, but its replicas did not confirm it in
    time (Redis `WAIT`): it holds there, and a failover before the replicas catch up could
    lose it. Check the key, and make the change again if it is not there."""

    def __init__(self, replicas: int, acknowledged: int, timeout: float) -> None:
        self.replicas = replicas
        self.acknowledged = acknowledged
        self.timeout = timeout
        super().__init__()

    def __str__(self) -> str:
        return (
            "the change was committed on the Redis master, but only "
            f"{self.acknowledged} of {self.replicas} replicas confirmed it within "
            f"{self.timeout:g} s: a failover now could lose it"
        )


class LimiterUnavailable(AuthUnavailable):
    """The rate-limit storage raised an error; `original` holds it."""


# -- refusals of the leak endpoints (apikeys.leaks) ---------------------------------------------


class MissingSignature(RequestRefused):
    """A secret scanning alert came without GitHub's signature headers."""

    status = 401
    code = "missing_signature"
    title = "Missing signature"
    detail = "Sign the body and send Github-Public-Key-Identifier and Github-Public-Key-Signature."


class InvalidSignature(RequestRefused):
    """A secret scanning alert's signature is malformed, or does not verify."""

    status = 401
    code = "invalid_signature"
    title = "Invalid signature"
    detail = "The signature does not match the body."


class MethodNotAllowed(RequestRefused):
    """The endpoint takes another method; `Allow` names it."""

    status = 405
    code = "method_not_allowed"
    title = "Method not allowed"

    def __init__(self, allowed: Sequence[str] = ("POST",)) -> None:
        self.allowed = tuple(allowed)
        self.headers = ((b"allow", ", ".join(self.allowed).encode("latin-1")),)
        super().__init__(f"This path accepts {', '.join(self.allowed)}.")


class PayloadTooLarge(RequestRefused):
    """The body is longer than the endpoint takes (counted as it arrives)."""

    status = 413
    code = "payload_too_large"
    title = "Payload too large"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"The request body must be at most {limit} bytes.")


class UnsupportedMediaType(RequestRefused):
    """The body is not declared `application/json` (UTF-8)."""

    status = 415
    code = "unsupported_media_type"
    title = "Unsupported media type"
    detail = "Send the body as JSON with 'Content-Type: application/json'."


class MalformedJSON(RequestRefused):
    """The body is not UTF-8 JSON (NaN, Infinity and duplicate members are refused too)."""

    status = 400
    code = "malformed_json"
    title = "Malformed JSON"


class InvalidPayload(RequestRefused):
    """The body is JSON, but not what the endpoint takes; `errors` lists the first problems,
    each `{"field", "message"}`."""

    status = 400
    code = "invalid_payload"
    title = "Invalid payload"
    detail = "The request body is not what this endpoint takes; see 'errors'."

    def __init__(self, errors: Sequence[Mapping[str, str]]) -> None:
        self.errors = tuple(dict(error) for error in errors)
        super().__init__()


class ForbiddenField(RequestRefused):
    """A change a workspace user may not make: `field` is the operator's (credits, rate
    limit, allowlist…), or a value the workspace user may not give it (an expiry later than
    the operator's, scopes beyond the caller's own). Nothing was changed. See
    `apikeys.fields`."""

    status = 403
    code = "forbidden_field"
    title = "Forbidden field"

    def __init__(self, field: str, why: str | None = None) -> None:
        self.field = field
        self.why = why
        super().__init__(
            f"The key's {field} may not be changed so: {why}; nothing was changed."
            if why
            else f"Only the operator may change the key's {field}; nothing was changed."
        )


class ResourceNotFound(RequestRefused):
    """A management call named a key or identity it cannot see: unknown, or another
    workspace's (both answer alike, so ids of other workspaces cannot be told apart)."""

    status = 404
    code = "not_found"
    title = "Not found"
    detail = "There is no such resource in your workspace."


class Conflict(RequestRefused):
    """A management call the current state forbids: enabling a revoked key, rolling a
    disabled one, an identity id that is taken, a retry while the first is running."""

    status = 409
    code = "conflict"
    title = "Conflict"


class PreconditionFailed(RequestRefused):
    """`If-Match` names another version than the current one: someone changed it since it
    was read. Nothing was changed; read it again."""

    status = 412
    code = "precondition_failed"
    title = "Precondition failed"
    detail = "The resource changed since it was read (If-Match); nothing was changed."


class IdempotencyKeyReused(RequestRefused):
    """An `Idempotency-Key` sent again with another request than the one it was first
    sent with. Nothing was done."""

    status = 422
    code = "idempotency_key_reused"
    title = "Idempotency key reused"
    detail = (
        "This Idempotency-Key was used with another request; use a new key for a new "
        "request. Nothing was done."
    )


class SigningKeysUnavailable(RequestRefused):
    """GitHub's list of signing keys could not be fetched or read, so no signature can be
    checked: the alert is refused, never trusted. `reason` says why, for the log."""

    status = 503
    code = "signing_keys_unavailable"
    title = "Signing keys unavailable"
    detail = (
        "GitHub's public keys cannot be fetched right now, so the signature cannot be "
        "checked. Nothing was done; retry shortly."
    )
    retry_after = 60

    def __init__(self, reason: str | None = None) -> None:
        self.reason = reason
        super().__init__()

    def __str__(self) -> str:
        return self.reason or self.detail
