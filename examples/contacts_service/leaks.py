"""`POST /api/v1/secret-scanning`: GitHub's secret scanning partner alerts.

When GitHub finds tokens matching the key pattern in public (a commit, an issue, a gist, an
npm package), it POSTs them here as a JSON array of `{"token", "type", "url", "source"}`,
signed with ECDSA P-256 / SHA-256 over the raw body: the signature, base64 DER, in
`Github-Public-Key-Signature`, and the id of the key that made it in
`Github-Public-Key-Identifier`. The public keys come from `EXAMPLE_GITHUB_KEYS_URL`
(`https://api.github.com/meta/public_keys/secret_scanning`).

The endpoint is public to `APIKeyMiddleware`: GitHub authenticates by signature, not by key.
It refuses, in this order: 401 without both headers or with malformed ones, 413 over 1 MiB,
503 when GitHub's keys cannot be fetched (nothing is revoked: it never fails open), 401 for
an unknown key identifier or a signature that does not verify, 415 not JSON, 400 not an
array of at most 1000 valid alerts. Then each token is judged:

- `true_positive`: the token is one of our keys, secret included. The key is revoked (or
  disabled, `EXAMPLE_LEAK_ACTION=disable`) unless it already is; a key already revoked,
  disabled or expired is still a true positive, because its secret is real.
- `false_positive`: anything else. A bad checksum or another prefix is decided without a
  store lookup; an unknown id or a wrong secret after one. A made-up secret next to a real
  (public) key id never gets that key revoked.

The answer is GitHub's feedback format, `[{"token_raw", "token_type", "label"}]`, in the
order of the alerts. Logs and audit events name keys by their masked form `ak_<id>_…`,
never the token.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from apikeys import KeyManager
from apikeys.errors import (
    AuthUnavailable,
    InvalidAPIKey,
    InvalidTransition,
    KeyDisabled,
    KeyExpired,
    KeyNotFound,
    KeyRevoked,
    MalformedAPIKey,
)
from apikeys.keys import ParsedKey, parse_key
from examples.contacts_service.payload import media_type_is_json, parse_json, read_body
from examples.contacts_service.problems import FieldError, Problem

__all__ = [
    "FALSE_POSITIVE",
    "LEAK_ACTOR",
    "MAX_ALERTS",
    "MAX_BODY_BYTES",
    "PATH",
    "TRUE_POSITIVE",
    "Alert",
    "GitHubKeys",
    "KeysUnavailable",
    "judge",
    "secret_scanning",
    "validate_alerts",
]

logger = logging.getLogger("examples.contacts_service")
audit = logging.getLogger("examples.contacts_service.audit")

PATH = "/api/v1/secret-scanning"
LEAK_ACTOR: Final = "github-secret-scanning"
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

IDENTIFIER_HEADER = "github-public-key-identifier"
SIGNATURE_HEADER = "github-public-key-signature"
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


class KeysUnavailable(Exception):
    """GitHub's key list could not be fetched or read; the reason names no secret."""


def parse_key_list(body: bytes) -> dict[str, ec.EllipticCurvePublicKey]:
    """`{"public_keys": [{"key_identifier", "key", "is_current"}]}` → P-256 keys by id.

    Entries that are not P-256 public keys in PEM are skipped with a warning; a list with
    no usable key at all is `KeysUnavailable`, like an unreachable one.
    """
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        raise KeysUnavailable("the key list is not JSON") from None
    entries = document.get("public_keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise KeysUnavailable("the key list has no 'public_keys' array")
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
        raise KeysUnavailable("the key list holds no P-256 key")
    return keys


class GitHubKeys:
    """GitHub's secret scanning public keys, fetched from `url` and kept in memory.

    `get(identifier)` answers from memory while the list is younger than `max_age`. An
    identifier the list does not hold fetches it again, at most once per
    `refetch_interval`, so forged identifiers cannot make this process hammer GitHub; in
    between, the identifier is unknown (`None`). A fetch that fails or times out, and a
    list too old that cannot be refreshed, are `KeysUnavailable`: a signature is never
    accepted without a key list to check it against.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = FETCH_TIMEOUT,
        refetch_interval: float = REFETCH_INTERVAL,
        max_age: float = KEYS_MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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
        `KeysUnavailable`."""
        if self._fresh(self.clock()) and identifier in self._keys:
            return self._keys[identifier]
        async with self._lock:  # one fetch at a time; the others wait and read its result
            now = self.clock()
            fresh = self._fresh(now)
            if fresh and identifier in self._keys:
                return self._keys[identifier]
            if self._attempted_at is not None and now - self._attempted_at < self.refetch_interval:
                if not fresh:  # the last attempt failed: still no list to trust
                    raise KeysUnavailable("the last fetch of GitHub's keys failed")
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
                    headers={"Accept": "application/json", "User-Agent": "apikeys-example"},
                ) as response,
            ):
                if response.status_code != 200:
                    raise KeysUnavailable(f"GitHub's key list answered {response.status_code}")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_KEY_LIST_BYTES:
                        raise KeysUnavailable("GitHub's key list is too large")
        except (httpx.HTTPError, TimeoutError, OSError) as exc:
            raise KeysUnavailable(f"GitHub's key list: {type(exc).__name__}") from None
        return parse_key_list(bytes(body))


def verify_signature(key: ec.EllipticCurvePublicKey, signature: bytes, body: bytes) -> bool:
    """Whether `signature` (DER) is `key`'s ECDSA SHA-256 signature of the raw `body`."""
    try:
        key.verify(signature, body, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
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
    errors: list[FieldError], where: str, value: object, maximum: int, *, minimum: int = 1
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
    """GitHub's alerts, or a 400 `Problem` listing the first errors.

    An array of at most `MAX_ALERTS` objects, each with `token`, `type` and `url` (may be
    empty) strings and, optionally, `source`. Other members are ignored, so a field GitHub
    adds later breaks nothing.
    """
    if not isinstance(data, list):
        raise Problem.invalid_payload([{"field": "body", "message": "must be a JSON array"}])
    if len(data) > MAX_ALERTS:
        raise Problem.invalid_payload(
            [{"field": "body", "message": f"must hold at most {MAX_ALERTS} alerts"}]
        )
    alerts: list[Alert] = []
    errors: list[FieldError] = []
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
        raise Problem.invalid_payload(errors[:MAX_ERRORS])
    return alerts


# -- verdicts ----------------------------------------------------------------------------------


async def _apply(manager: KeyManager, action: str, key_id: str) -> None:
    """Revoke or disable the key `key_id` on GitHub's report: the audit trail records it as
    `leak_revoked` (or `disabled`, reason `leaked`), by `LEAK_ACTOR`."""
    if action == "disable":
        await manager.disable(key_id, actor=LEAK_ACTOR, reason="leaked")
    else:
        await manager.revoke(key_id, actor=LEAK_ACTOR, leaked=True)


def _audit(event: str, parsed: ParsedKey, alert: Alert) -> None:
    """One audit event: what happened to which key (masked), by whom, on what evidence."""
    audit.warning(
        "%s key=%s actor=%s type=%r source=%r url=%r",
        event,
        parsed.masked,
        LEAK_ACTOR,
        alert.type,
        alert.source,
        alert.url,
    )


async def judge(manager: KeyManager, alert: Alert, action: str) -> str:
    """`TRUE_POSITIVE` (and the key revoked or disabled) or `FALSE_POSITIVE`.

    Raises `AuthUnavailable` when the key store cannot be reached.
    """
    try:
        parsed = parse_key(alert.token, manager.prefix)
    except MalformedAPIKey:
        logger.info("secret scanning: %s: not in the key format", FALSE_POSITIVE)
        return FALSE_POSITIVE
    # The secret is checked before anything is done: a key id is public, and a planted
    # token with a real id and a made-up secret must not get that key revoked.
    state = "active"
    try:
        await manager.verify(alert.token, record_usage=False)
    except InvalidAPIKey:
        logger.info(
            "secret scanning: %s: %s: unknown id or wrong secret", FALSE_POSITIVE, parsed.masked
        )
        return FALSE_POSITIVE
    except KeyRevoked:
        state = "revoked"
    except KeyDisabled:
        state = "disabled"
    except KeyExpired:
        state = "expired"  # expired, but active: revoked or disabled all the same
    done = {"revoke": ("revoked",), "disable": ("revoked", "disabled")}[action]
    if state in done:
        outcome = f"already {state}"
    else:
        try:
            await _apply(manager, action, parsed.id)
        except (InvalidTransition, KeyNotFound):
            outcome = "changed meanwhile"  # revoked (or deleted) by someone else just now
        else:
            outcome = "revoked" if action == "revoke" else "disabled"
            _audit(f"key.{outcome}", parsed, alert)
    logger.warning(
        "secret scanning: %s: %s found in public (%r), %s",
        TRUE_POSITIVE,
        parsed.masked,
        alert.url,
        outcome,
    )
    return TRUE_POSITIVE


# -- the endpoint ------------------------------------------------------------------------------


def _signature_headers(request: Request) -> tuple[str, bytes]:
    """The key identifier and the DER signature, or 401 before the body is read."""
    identifiers = request.headers.getlist(IDENTIFIER_HEADER)
    signatures = request.headers.getlist(SIGNATURE_HEADER)
    if len(identifiers) > 1 or len(signatures) > 1:
        raise Problem.invalid_signature("Send each signature header once.")
    identifier = identifiers[0].strip() if identifiers else ""
    signature = signatures[0].strip() if signatures else ""
    if not identifier or not signature:  # absent or blank
        raise Problem.missing_signature()
    if not _IDENTIFIER.fullmatch(identifier) or not _SIGNATURE.fullmatch(signature):
        raise Problem.invalid_signature("The signature headers are malformed.")
    try:
        der = base64.b64decode(signature, validate=True)
        decode_dss_signature(der)  # not even a signature: refused without fetching any key
    except (binascii.Error, ValueError):
        raise Problem.invalid_signature("The signature is not base64 DER.") from None
    return identifier, der


async def secret_scanning(request: Request) -> Response:
    identifier, signature = _signature_headers(request)
    body = await read_body(request, MAX_BODY_BYTES)
    github_keys: GitHubKeys = request.app.state.github_keys
    try:
        key = await github_keys.get(identifier)
    except KeysUnavailable as exc:
        logger.warning("secret scanning: refused an alert: %s", exc)
        raise Problem.signing_keys_unavailable() from None
    if key is None:
        raise Problem.invalid_signature("GitHub lists no key with this identifier.")
    if not verify_signature(key, signature, body):
        raise Problem.invalid_signature("The signature does not match the body.")
    if not media_type_is_json(request.headers.get("content-type")):
        raise Problem.unsupported_media_type()
    alerts = validate_alerts(parse_json(body))
    manager: KeyManager = request.app.state.manager
    action: str = request.app.state.settings.leak_action
    labels: dict[str, str] = {}  # a token reported twice is judged once
    try:
        for alert in alerts:
            if alert.token not in labels:
                labels[alert.token] = await judge(manager, alert, action)
    except AuthUnavailable as exc:
        logger.warning("secret scanning: the key store is unavailable: %s", exc)
        raise Problem.store_unavailable() from None
    return JSONResponse(
        [
            {"token_raw": alert.token, "token_type": alert.type, "label": labels[alert.token]}
            for alert in alerts
        ],
        headers={"Cache-Control": "no-store"},
    )
