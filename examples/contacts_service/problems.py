"""The service's own errors, shaped like the middleware's: RFC 9457 problem+json.

Every error body has `type`, `title`, `status`, `detail` and a machine-readable `code`,
whether the middleware refused the key or the service refused the request, so a client
needs one error parser. Field errors add `errors: [{"field", "message"}]`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from apikeys.problems import PROBLEM_CONTENT_TYPE, TYPE_BASE

__all__ = ["FieldError", "Problem", "exception_handlers"]

logger = logging.getLogger("examples.contacts_service")

FieldError = Mapping[str, str]
"""`{"field": "phone", "message": "…"}`"""


class Problem(Exception):
    """Raise it from an endpoint to answer with a problem+json response."""

    def __init__(
        self,
        status: int,
        code: str,
        title: str,
        detail: str,
        *,
        errors: Sequence[FieldError] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.title = title
        self.detail = detail
        self.errors = errors
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": TYPE_BASE + self.code,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if self.errors is not None:
            body["errors"] = [dict(error) for error in self.errors]
        return body

    def response(self) -> Response:
        return JSONResponse(
            self.body(),
            status_code=self.status,
            headers={"Cache-Control": "no-store", **self.headers},
            media_type=PROBLEM_CONTENT_TYPE,
        )

    # -- the problems the service raises ----------------------------------------------------

    @classmethod
    def invalid_parameter(cls, name: str, message: str) -> Problem:
        return cls(
            400,
            "invalid_parameter",
            "Invalid query parameter",
            f"The query parameter {name!r} {message}.",
            errors=[{"field": name, "message": message}],
        )

    @classmethod
    def malformed_json(cls, reason: str) -> Problem:
        return cls(400, "malformed_json", "Malformed JSON", f"The request body {reason}.")

    @classmethod
    def not_found(cls, what: str = "resource") -> Problem:
        return cls(404, "not_found", "Not found", f"No such {what}.")

    @classmethod
    def payload_too_large(cls, limit: int) -> Problem:
        return cls(
            413,
            "payload_too_large",
            "Payload too large",
            f"The request body must be at most {limit} bytes.",
        )

    @classmethod
    def unsupported_media_type(cls) -> Problem:
        return cls(
            415,
            "unsupported_media_type",
            "Unsupported media type",
            "Send the body as JSON with 'Content-Type: application/json'.",
        )

    @classmethod
    def invalid_payload(cls, errors: Sequence[FieldError]) -> Problem:
        return cls(
            400,
            "invalid_payload",
            "Invalid payload",
            "The request body is not what this endpoint takes; see 'errors'.",
            errors=errors,
        )

    @classmethod
    def missing_signature(cls) -> Problem:
        return cls(
            401,
            "missing_signature",
            "Missing signature",
            "Sign the body and send Github-Public-Key-Identifier and Github-Public-Key-Signature.",
        )

    @classmethod
    def invalid_signature(cls, detail: str) -> Problem:
        return cls(401, "invalid_signature", "Invalid signature", detail)

    @classmethod
    def signing_keys_unavailable(cls) -> Problem:
        return cls(
            503,
            "signing_keys_unavailable",
            "Signing keys unavailable",
            "GitHub's public keys cannot be fetched right now, so the signature cannot be "
            "checked. Nothing was done; retry shortly.",
            headers={"Retry-After": "60"},
        )

    @classmethod
    def store_unavailable(cls) -> Problem:
        return cls(
            503,
            "auth_unavailable",
            "Authentication unavailable",
            "API keys cannot be checked right now. Retry shortly.",
            headers={"Retry-After": "1"},
        )

    @classmethod
    def validation_failed(cls, errors: Sequence[FieldError]) -> Problem:
        return cls(
            422,
            "validation_failed",
            "Validation failed",
            "The request body has invalid fields; see 'errors'.",
            errors=errors,
        )


def _is_api(request: Request) -> bool:
    # The scope's path, never `request.url` (see web._is_api: it fails on non-UTF-8 queries).
    path: str = request.scope["path"]
    return path.startswith("/api/")


async def _problem(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Problem)
    return exc.response()


async def _http_exception(request: Request, exc: Exception) -> Response:
    """404 and 405 from the router: problem+json under /api/, Starlette's text elsewhere."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    if not _is_api(request):
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=headers)
    if exc.status_code == 404:
        return Problem.not_found().response()
    if exc.status_code == 405:
        allowed = headers.get("Allow", "")
        return Problem(
            405,
            "method_not_allowed",
            "Method not allowed",
            f"This path accepts {allowed}." if allowed else "This path accepts no method.",
            headers=headers,
        ).response()
    code = exc.detail.lower().replace(" ", "_")
    return Problem(exc.status_code, code, exc.detail, exc.detail, headers=headers).response()


def _unavailable() -> Response:
    return Problem(
        503,
        "service_unavailable",
        "Service unavailable",
        "The database cannot be reached right now. Retry shortly.",
        headers={"Retry-After": "1"},
    ).response()


async def _database_error(request: Request, exc: Exception) -> Response:
    # A database that is down or busy is the client's cue to retry; anything else is a bug.
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError) or (
        isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
    ):
        logger.warning("database unavailable: %s", type(exc).__name__)
        return _unavailable()
    raise exc


async def _connection_error(request: Request, exc: Exception) -> Response:
    logger.warning("database unavailable: %s", type(exc).__name__)
    return _unavailable()


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this response, so the server logs the traceback.
    return Problem(
        500,
        "internal_error",
        "Internal server error",
        "The server failed to handle the request.",
    ).response()


exception_handlers = {
    Problem: _problem,
    HTTPException: _http_exception,
    sa_exc.SQLAlchemyError: _database_error,
    OSError: _connection_error,
    Exception: _internal_error,
}
"""Starlette `exception_handlers` for every error the service can meet."""
