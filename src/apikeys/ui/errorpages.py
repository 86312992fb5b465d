"""The page's error pages: what a `PageError`, a refused form, an HTTP error (404, 405) or
an unreachable key store look like, in the page's own layout."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from apikeys.errors import AuthUnavailable, ForbiddenField
from apikeys.ui.forms import FormRefused
from apikeys.ui.request import PageError, render

__all__ = ["EXCEPTION_HANDLERS"]

_HTTP_TITLES = {
    404: ("Page not found", "There is no page at this address."),
    405: ("Method not allowed", "This page cannot be used that way."),
}


def _error_page(
    request: Request,
    status: int,
    title: str,
    message: str,
    headers: Mapping[str, str] = {},
    *,
    code: str | None = None,
    field: str | None = None,
) -> Response:
    if "session" not in request.scope:  # e.g. a 404 under /static/
        request.scope["session"] = {}
    response = render(
        request,
        "error.html",
        status=status,
        title=title,
        message=message,
        status_code=status,
        code=code,
        field=field,
    )
    response.headers.update(headers)
    return response


async def _page_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PageError | FormRefused)
    return _error_page(request, exc.status, exc.title, exc.message)


async def _forbidden_field(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ForbiddenField)
    why = f"{exc.why[:1].upper()}{exc.why[1:]}." if exc.why else "The operator sets it."
    return _error_page(
        request,
        exc.status,
        "This field is not yours to change",
        f"{why} Nothing was changed.",
        code=exc.code,
        field=exc.field,
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    title, message = _HTTP_TITLES.get(exc.status_code, (exc.detail, exc.detail))
    return _error_page(request, exc.status_code, title, message, exc.headers or {})


async def _unavailable(request: Request, exc: Exception) -> Response:
    return _error_page(
        request,
        503,
        "Keys are unavailable",
        "The key store cannot be reached right now. Try again shortly.",
        {"Retry-After": "1"},
    )


EXCEPTION_HANDLERS = {
    PageError: _page_error,
    FormRefused: _page_error,
    ForbiddenField: _forbidden_field,
    HTTPException: _http_error,
    AuthUnavailable: _unavailable,
}
