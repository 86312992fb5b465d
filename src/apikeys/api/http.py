"""What every endpoint of the management API shares: who calls, reading a bounded JSON
body, answering JSON with an `ETag`, checking `If-Match`, and turning every error into
problem+json (`apikeys.problems`), so nothing a client sends becomes a 500.

The caller is the key the middleware admitted (`scope["apikey"]`): its workspace is the
only one the call sees. A key or identity of another workspace is `ResourceNotFound`,
exactly as an unknown id, body for body.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from functools import wraps
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import Response

from apikeys.api.operations import ADMIN_SCOPE
from apikeys.errors import (
    APIKeyError,
    Conflict,
    DuplicateKeyId,
    InsufficientScope,
    InvalidKeyParameters,
    InvalidPayload,
    InvalidTransition,
    KeyNotFound,
    PreconditionFailed,
    RequestRefused,
    ResourceNotFound,
)
from apikeys.identities import IdentityRecord
from apikeys.leaks.http import parse_json, read_body, require_json
from apikeys.problems import encode_problem
from apikeys.types import KeyRecord

__all__ = [
    "MAX_BODY_BYTES",
    "Caller",
    "Endpoint",
    "answers",
    "check_if_match",
    "etag_of",
    "json_response",
    "problem_response",
    "read_json",
    "refusal_of",
]

logger = logging.getLogger("apikeys")

MAX_BODY_BYTES: Final = 16 * 1024
"""The longest request body the management API reads (a key's metadata is at most 4 KiB)."""

# What changes with every request a key or identity serves: not part of its version, so
# that a key in use can still be edited with the ETag it was read with.
_VOLATILE: Final = frozenset({"last_used_at", "request_count", "credits"})

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class Caller:
    """The key a management call is made with: its record, and what it holds."""

    record: KeyRecord

    @classmethod
    def of(cls, request: Request) -> Caller:
        record = request.scope.get("apikey")
        if not isinstance(record, KeyRecord):  # pragma: no cover - the middleware sets it
            raise RuntimeError("the management API runs behind APIKeyMiddleware")
        return cls(record)

    @property
    def workspace(self) -> str:
        return self.record.workspace

    @property
    def actor(self) -> str:
        """How the audit trail names the caller: `key:<id>`."""
        return f"key:{self.record.id}"

    @property
    def scope_ceiling(self) -> tuple[str, ...] | None:
        """The scopes it may grant: its own (None: any, for a full-access key)."""
        return None if self.record.full_access else self.record.scopes

    def sees(self, workspace: str) -> bool:
        """Whether the caller may see what belongs to `workspace`: its own workspace's."""
        return workspace == self.record.workspace

    def sees_key(self, record: KeyRecord) -> bool:
        """Whether the caller may see the key `record`: one of its own workspace and its own
        environment (a test key never sees nor changes live keys, nor the reverse)."""
        return self.sees(record.workspace) and record.environment == self.record.environment

    def check_admin(self) -> None:
        """`InsufficientScope` unless the caller's key names `apikeys:admin` among its
        scopes: an identity's limits and credits are the operator's, so full access alone
        (which passes every other scope check) does not give them."""
        if ADMIN_SCOPE not in self.record.scopes:
            raise InsufficientScope((ADMIN_SCOPE,))


def etag_of(record: KeyRecord | IdentityRecord) -> str:
    """The strong `ETag` of `record`'s version: what an edit may change of it."""
    shown = {k: v for k, v in record.to_dict().items() if k not in _VOLATILE}
    text = json.dumps(shown, sort_keys=True, separators=(",", ":"), default=str)
    return '"' + hashlib.sha256(text.encode()).hexdigest()[:32] + '"'


def check_if_match(request: Request, record: KeyRecord | IdentityRecord) -> None:
    """`PreconditionFailed` unless `If-Match` (when sent) names `record`'s version or `*`."""
    wanted = request.headers.get("if-match")
    if wanted is None:
        return
    tags = [tag.strip() for tag in wanted.split(",")]
    if "*" not in tags and etag_of(record) not in tags:
        raise PreconditionFailed()


def json_response(
    status: int,
    document: Any,
    *,
    etag: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """A JSON answer that no cache keeps, with `etag` when given."""
    extra = {"cache-control": "no-store", **(headers or {})}
    if etag is not None:
        extra["etag"] = etag
    body = json.dumps(document, separators=(",", ":")).encode()
    return Response(body, status, headers=extra, media_type="application/json")


def problem_response(exc: RequestRefused) -> Response:
    """`exc` as its problem+json answer."""
    raw, body = encode_problem(exc)
    response = Response(body, exc.status)
    response.raw_headers = list(raw)
    return response


async def read_json(request: Request, *, empty_ok: bool = False) -> object:
    """The request's JSON body (`PayloadTooLarge` past `MAX_BODY_BYTES`,
    `UnsupportedMediaType`, `MalformedJSON`); `{}` for no body at all when `empty_ok`."""
    body = await read_body(request.scope, request.receive, MAX_BODY_BYTES)
    if not body and empty_ok:
        return {}
    require_json(request.scope)
    return parse_json(body)


def refusal_of(exc: APIKeyError) -> RequestRefused:
    """The HTTP refusal a management call answers `exc` with."""
    if isinstance(exc, RequestRefused):
        return exc
    if isinstance(exc, KeyNotFound):
        return ResourceNotFound()
    if isinstance(exc, InvalidTransition):
        return Conflict(f"It cannot be done: {exc.why or 'its state forbids it'}.")
    if isinstance(exc, DuplicateKeyId):
        return Conflict("That id is taken.")
    if isinstance(exc, InvalidKeyParameters):
        return InvalidPayload([{"field": "", "message": str(exc)[:300]}])
    logger.error("apikeys: management call failed: %s", type(exc).__name__)
    return Conflict("It cannot be done now.")


def _check_printable(request: Request) -> None:
    """No id holds a control character (`ResourceNotFound`, before any store is asked: a NUL
    is an error to PostgreSQL, not an unknown id), nor does a query parameter
    (`InvalidPayload`)."""
    for value in request.path_params.values():
        if isinstance(value, str) and not value.isprintable():
            raise ResourceNotFound()
    for name, value in request.query_params.multi_items():
        if not value.isprintable():
            raise InvalidPayload([{"field": name[:50], "message": "holds a control character"}])


def answers(endpoint: Endpoint, query: Collection[str] = ()) -> Endpoint:
    """`endpoint`, answering every apikeys error as problem+json; a query parameter other
    than those named in `query` is `InvalidPayload`, as an unknown field of a body is."""
    taken = frozenset(query)

    @wraps(endpoint)
    async def answer(request: Request) -> Response:
        try:
            unknown = [name for name in request.query_params if name not in taken]
            if unknown:
                message = "is not a parameter of this request"
                raise InvalidPayload(
                    [{"field": name[:50], "message": message} for name in unknown[:10]]
                )
            _check_printable(request)
            return await endpoint(request)
        except APIKeyError as exc:
            return problem_response(refusal_of(exc))

    return answer
