"""GitHub's secret scanning partner alerts: a signed POST of the tokens GitHub found in public.

When GitHub finds tokens matching a registered key pattern in public (a commit, an issue, a
gist, an npm package), it POSTs them to the partner's URL as a JSON array of
`{"token", "type", "url", "source"}`, signed with ECDSA P-256 / SHA-256 over the raw body:
the signature, base64 DER, in `Github-Public-Key-Signature`, and the id of the key that made
it in `Github-Public-Key-Identifier`. The public keys are listed at `GITHUB_KEYS_URL`.

`SecretScanningReceiver` is that URL's ASGI app. It refuses, in this order: 405 for another
method; 401 without both headers or with malformed ones (before the body is read); 413 over
1 MiB; 503 when GitHub's keys cannot be fetched (nothing is done: it never fails open); 401
for an unknown key identifier or a signature that does not verify; 415 not JSON; 400 not an
array of at most 1000 valid alerts. Then each token is judged (`apikeys.leaks.verdicts`):

- `true_positive`: the token is one of the manager's keys, secret included. The key is
  revoked (or disabled, `action="disable"`) unless it already is; a key already revoked,
  disabled or expired is still a true positive, because its secret is real.
- `false_positive`: anything else. A bad checksum or another prefix is decided without a
  store lookup; an unknown id or a wrong secret after one.

The answer is GitHub's feedback format, `[{"token_raw", "token_type", "label"}]`, in the
order of the alerts. Log lines (logger `apikeys.leaks`) name keys by their masked form
`ak_<id>_…`, never the token. Needs the `github` extra: `pip install 'apikeys[github]'`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

try:
    import httpx
    from cryptography.exceptions import InvalidSignature as BadSignature
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installed extras
    raise ModuleNotFoundError(
        "GitHub's secret scanning alerts need cryptography and httpx. "
        "Install them with: pip install 'apikeys[github]'",
        name=exc.name,
    ) from None

from apikeys.errors import (
    AuthUnavailable,
    ConfigurationError,
    InvalidPayload,
    InvalidSignature,
    MalformedAPIKey,
    MethodNotAllowed,
    MissingSignature,
    RequestRefused,
    SigningKeysUnavailable,
)
from apikeys.keys import parse_key_of
from apikeys.leaks.http import header_values, parse_json, read_body, require_json, send_json
from apikeys.leaks.verdicts import LEAK_ACTIONS, LeakAction, act_on_leak
from apikeys.manager import KeyManager
from apikeys.problems import send_problem
from apikeys.types import Receive, Scope, Send

__all__ = [
    "FALSE_POSITIVE",
    "GITHUB_KEYS_URL",
    "GITHUB_LEAK_ACTOR",
    "MAX_ALERTS",
    "MAX_BODY_BYTES",
    "TRUE_POSITIVE",
    "Alert",
    "GitHubKeys",
    "SecretScanningReceiver",
    "parse_key_list",
    "validate_alerts",
    "verify_signature",
]

logger = logging.getLogger("apikeys.leaks")

GITHUB_KEYS_URL = "https://api.github.com/meta/public_keys/secret_scanning"
"""Where GitHub publishes the keys that sign its secret scanning alerts."""
GITHUB_LEAK_ACTOR: Final = "github-secret-scanning"
"""Who revokes or disables a key that GitHub reports: the actor of its audit events."""

TRUE_POSITIVE = "true_positive"
FALSE_POSITIVE = "false_positive"

MAX_BODY_BYTES = 1024 * 1024
MAX_ALERTS = 1000
MAX_ERRORS = 20
"""Field errors listed in a 400, at most: the first ones are enough to find the bug."""
TOKEN_MAX = 1024
TYPE_MAX = 200
URL_MAX = 4096
SOURCE_MAX = 100

IDENTIFIER_HEADER = b"github-public-key-identifier"
SIGNATURE_HEADER = b"github-public-key-signature"
_IDENTIFIER = re.compile(r"[!-~]{1,256}")  # printable ASCII, no spaces
_SIGNATURE = re.compile(r"[A-Za-z0-9+/]{1,512}={0,2}")
# Control characters have no place in an alert; lone surrogates cannot even be answered.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")

FETCH_TIMEOUT = 5.0
"""Seconds a fetch of GitHub's key list may take, all in all."""
REFETCH_INTERVAL = 60.0
"""An unknown key identifier refetches the list at most this often (seconds)."""
KEYS_MAX_AGE = 3600.0
"""The list is fetched again when it is this old (seconds): a key GitHub withdraws stops
verifying within the hour, even in a process that never restarts."""
MAX_KEY_LIST_BYTES = 256 * 1024


# -- GitHub's public keys ----------------------------------------------------------------------


def parse_key_list(body: bytes) -> dict[str, ec.EllipticCurvePublicKey]:
    """`{"public_keys": [{"key_identifier", "key", "is_current"}]}` → P-256 keys by id.

    Entries that are not P-256 public keys in PEM are skipped with a warning; a list with
    no usable key at all is `SigningKeysUnavailable`, like an unreachable one.
    """
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        raise SigningKeysUnavailable("the key list is not JSON") from None
    entries = document.get("public_keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise SigningKeysUnavailable("the key list has no 'public_keys' array")
    keys: dict[str, ec.EllipticCurvePublicKey] = {}
    for entry in entries:
        identifier = entry.get("key_identifier") if isinstance(entry, dict) else None
        pem = entry.get("key") if isinstance(entry, dict) else None
        if not (isinstance(identifier, str) and isinstance(pem, str)):
            logger.warning("secret scanning: skipped a malformed entry of GitHub's key list")
            continue
        try:
            key = serialization.load_pem_public_key(pem.encode("utf-8"))
        except (ValueError, TypeError, UnicodeError, UnsupportedAlgorithm):
            key = None
        if not (isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"):
            logger.warning("secret scanning: skipped GitHub key %r: not a P-256 key", identifier)
            continue
        keys[identifier] = key
    if not keys:
        raise SigningKeysUnavailable("the key list holds no P-256 key")
    return keys


class GitHubKeys:
    """GitHub's secret scanning public keys, fetched from `url` and kept in memory.

    `get(identifier)` answers from memory while the list is younger than `max_age`. An
    identifier the list does not hold fetches it again, at most once per
    `refetch_interval`, so forged identifiers cannot make this process hammer GitHub; in
    between, the identifier is unknown (`None`). A fetch that fails or times out, and a
    list too old that cannot be refreshed, are `SigningKeysUnavailable`: a signature is
    never accepted without a key list to check it against.
    """

    def __init__(
        self,
        url: str = GITHUB_KEYS_URL,
        *,
        timeout: float = FETCH_TIMEOUT,
        refetch_interval: float = REFETCH_INTERVAL,
        max_age: float = KEYS_MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not url.startswith(("https://", "http://")):
            raise ConfigurationError("GitHub's key list URL must be an https:// (or http://) URL")
        self.url = url
        self.timeout = timeout
        self.refetch_interval = refetch_interval
        self.max_age = max_age
        self.clock = clock
        self.fetches = 0
        """Fetches attempted so far (a counter for tests and metrics)."""
        self._keys: dict[str, ec.EllipticCurvePublicKey] = {}
        self._loaded_at: float | None = None
        self._attempted_at: float | None = None
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"GitHubKeys(url={self.url!r}, keys={len(self._keys)})"

    def _fresh(self, now: float) -> bool:
        return self._loaded_at is not None and now - self._loaded_at < self.max_age

    async def get(self, identifier: str) -> ec.EllipticCurvePublicKey | None:
        """The key `identifier` names, None if GitHub lists no such key; or raise
        `SigningKeysUnavailable`."""
        if self._fresh(self.clock()) and identifier in self._keys:
            return self._keys[identifier]
        async with self._lock:  # one fetch at a time; the others wait and read its result
            now = self.clock()
            fresh = self._fresh(now)
            if fresh and identifier in self._keys:
                return self._keys[identifier]
            if self._attempted_at is not None and now - self._attempted_at < self.refetch_interval:
                if not fresh:  # the last attempt failed: still no list to trust
                    raise SigningKeysUnavailable("the last fetch of GitHub's keys failed")
                return None
            self._attempted_at = now
            self.fetches += 1
            keys = await self._fetch()
            self._keys, self._loaded_at = keys, self.clock()
            return keys.get(identifier)

    async def _fetch(self) -> dict[str, ec.EllipticCurvePublicKey]:
        try:
            # httpx's timeouts bound each step; this bounds the whole (a slow drip included).
            async with (
                asyncio.timeout(self.timeout),
                httpx.AsyncClient(timeout=self.timeout) as client,
                client.stream(
                    "GET",
                    self.url,
                    headers={"Accept": "application/json", "User-Agent": "apikeys"},
                ) as response,
            ):
                if response.status_code != 200:
                    raise SigningKeysUnavailable(
                        f"GitHub's key list answered {response.status_code}"
                    )
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_KEY_LIST_BYTES:
                        raise SigningKeysUnavailable("GitHub's key list is too large")
        except (httpx.HTTPError, TimeoutError, OSError) as exc:
            raise SigningKeysUnavailable(f"GitHub's key list: {type(exc).__name__}") from None
        return parse_key_list(bytes(body))


def verify_signature(key: ec.EllipticCurvePublicKey, signature: bytes, body: bytes) -> bool:
    """Whether `signature` (DER) is `key`'s ECDSA SHA-256 signature of the raw `body`."""
    try:
        key.verify(signature, body, ec.ECDSA(hashes.SHA256()))
    except (BadSignature, ValueError):
        return False
    return True


# -- alerts ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Alert:
    """One match GitHub reports. The repr leaves the token out."""

    token: str = field(repr=False)
    type: str
    url: str
    source: str | None = None


def _string(
    errors: list[dict[str, str]], where: str, value: object, maximum: int, *, minimum: int = 1
) -> str | None:
    if not isinstance(value, str):
        errors.append({"field": where, "message": "must be a string"})
    elif not minimum <= len(value) <= maximum:
        errors.append(
            {"field": where, "message": f"must be {minimum} to {maximum} characters long"}
        )
    elif _UNPRINTABLE.search(value):
        errors.append({"field": where, "message": "must not contain control characters"})
    else:
        return value
    return None


def validate_alerts(data: Any) -> list[Alert]:
    """GitHub's alerts, or `InvalidPayload` listing the first errors.

    An array of at most `MAX_ALERTS` objects, each with `token`, `type` and `url` (may be
    empty) strings and, optionally, `source`. Other members are ignored, so a field GitHub
    adds later breaks nothing.
    """
    if not isinstance(data, list):
        raise InvalidPayload([{"field": "body", "message": "must be a JSON array"}])
    if len(data) > MAX_ALERTS:
        raise InvalidPayload(
            [{"field": "body", "message": f"must hold at most {MAX_ALERTS} alerts"}]
        )
    alerts: list[Alert] = []
    errors: list[dict[str, str]] = []
    for index, item in enumerate(data):
        if not isinstance(item, dict):
            errors.append({"field": f"[{index}]", "message": "must be an object"})
            continue
        token = _string(errors, f"[{index}].token", item.get("token"), TOKEN_MAX)
        kind = _string(errors, f"[{index}].type", item.get("type"), TYPE_MAX)
        url = _string(errors, f"[{index}].url", item.get("url"), URL_MAX, minimum=0)
        source = item.get("source")
        if source is not None:
            source = _string(errors, f"[{index}].source", source, SOURCE_MAX, minimum=0)
        if token is not None and kind is not None and url is not None:
            alerts.append(Alert(token=token, type=kind, url=url, source=source))
    if errors:
        raise InvalidPayload(errors[:MAX_ERRORS])
    return alerts


# -- the endpoint ------------------------------------------------------------------------------


def _signature_headers(scope: Mapping[str, Any]) -> tuple[str, bytes]:
    """The key identifier and the DER signature, or 401 before the body is read."""
    identifiers = header_values(scope, IDENTIFIER_HEADER)
    signatures = header_values(scope, SIGNATURE_HEADER)
    if len(identifiers) > 1 or len(signatures) > 1:
        raise InvalidSignature("Send each signature header once.")
    identifier = identifiers[0].strip() if identifiers else ""
    signature = signatures[0].strip() if signatures else ""
    if not identifier or not signature:  # absent or blank
        raise MissingSignature()
    if not _IDENTIFIER.fullmatch(identifier) or not _SIGNATURE.fullmatch(signature):
        raise InvalidSignature("The signature headers are malformed.")
    try:
        der = base64.b64decode(signature, validate=True)
        decode_dss_signature(der)  # not even a signature: refused without fetching any key
    except (binascii.Error, ValueError):
        raise InvalidSignature("The signature is not base64 DER.") from None
    return identifier, der


class SecretScanningReceiver:
    """The ASGI app GitHub's secret scanning alerts are POSTed to.

    ```python
    app.mount("/github/secret-scanning", SecretScanningReceiver(manager))
    ```

    Every alert is checked against GitHub's signature (`keys`, by default the list at
    `keys_url`), and each token that is one of `manager`'s keys, secret included, is
    revoked (`leak_revoked` in the audit trail) or, with `action="disable"`, disabled
    (reason `leaked`), by `actor`. The app answers every path it is given: mount it, or
    route one path to it (`Route("/github/secret-scanning", receiver)`). Keep it public
    to `APIKeyMiddleware`: GitHub signs its requests, it has no API key.
    """

    def __init__(
        self,
        manager: KeyManager,
        *,
        action: LeakAction = "revoke",
        keys_url: str = GITHUB_KEYS_URL,
        keys: GitHubKeys | None = None,
        actor: str = GITHUB_LEAK_ACTOR,
    ) -> None:
        if action not in LEAK_ACTIONS:
            raise ConfigurationError(f"action must be 'revoke' or 'disable', not {action!r}")
        self.manager = manager
        self.action: LeakAction = action
        self.keys = keys if keys is not None else GitHubKeys(keys_url)
        self.actor = actor

    def __repr__(self) -> str:
        return f"SecretScanningReceiver(action={self.action!r}, keys={self.keys!r})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan or websocket work: mounted apps get none anyway
        try:
            answer = await self._answer(scope, receive)
        except RequestRefused as exc:
            if isinstance(exc, SigningKeysUnavailable):
                logger.warning("secret scanning: refused an alert: %s", exc)
            elif isinstance(exc, AuthUnavailable):
                logger.warning("secret scanning: the key store is unavailable: %s", exc)
            await send_problem(send, exc)
            return
        await send_json(send, 200, answer)

    async def _answer(self, scope: Scope, receive: Receive) -> list[dict[str, str]]:
        if scope.get("method") != "POST":
            raise MethodNotAllowed(["POST"])
        identifier, signature = _signature_headers(scope)
        body = await read_body(scope, receive, MAX_BODY_BYTES)
        key = await self.keys.get(identifier)
        if key is None:
            raise InvalidSignature("GitHub lists no key with this identifier.")
        if not verify_signature(key, signature, body):
            raise InvalidSignature("The signature does not match the body.")
        require_json(scope)
        alerts = validate_alerts(parse_json(body))
        labels: dict[str, str] = {}  # a token reported twice is judged once
        for alert in alerts:
            if alert.token not in labels:
                labels[alert.token] = await self._judge(alert)
        return [
            {"token_raw": alert.token, "token_type": alert.type, "label": labels[alert.token]}
            for alert in alerts
        ]

    async def _judge(self, alert: Alert) -> str:
        outcome = await act_on_leak(self.manager, alert.token, action=self.action, actor=self.actor)
        if outcome == "not confirmed":
            try:
                masked = parse_key_of(alert.token, self.manager.prefix).masked
            except MalformedAPIKey:
                logger.info("secret scanning: %s: not in the key format", FALSE_POSITIVE)
            else:
                logger.info(
                    "secret scanning: %s: %s: unknown id or wrong secret", FALSE_POSITIVE, masked
                )
            return FALSE_POSITIVE
        logger.warning(
            "secret scanning: %s: %s found in public (%r, type %r, source %r), %s",
            TRUE_POSITIVE,
            parse_key_of(alert.token, self.manager.prefix).masked,
            alert.url,
            alert.type,
            alert.source,
            outcome,
        )
        return TRUE_POSITIVE
