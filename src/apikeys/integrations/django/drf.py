"""The Django REST framework classes of `apikeys.integrations.django` (imported from there)."""

from __future__ import annotations

import json
from typing import Any, cast

try:
    from rest_framework.authentication import BaseAuthentication
    from rest_framework.exceptions import APIException
    from rest_framework.permissions import BasePermission
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installed extras
    raise ModuleNotFoundError(
        "the Django REST framework classes need djangorestframework. "
        "Install it with: pip install 'apikeys[drf]'",
        name=exc.name,
    ) from None

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse

from apikeys.errors import MissingAPIKey
from apikeys.integrations.django import (
    Outcome,
    Refusal,
    check_request,
    current_realm,
    required_scopes,
)
from apikeys.middleware import APIKeyAuth, APIKeyUser
from apikeys.scopes import GrantedScopes

__all__ = ["APIKeyAuthentication", "APIKeyRefused", "HasScopes", "exception_handler"]


class APIKeyRefused(APIException):  # type: ignore[misc]
    """A refusal, as DRF raises it: its status, its problem document as `detail`, and the
    middleware's exact response in `refusal` (what `exception_handler` answers with)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__()
        self.refusal = refusal
        self.status_code = refusal.status
        # Not coerced to DRF's error strings: the problem document as the middleware sends it.
        self.detail = json.loads(refusal.body)
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in refusal.headers
        }
        # What DRF's own exception handler turns into headers.
        self.auth_header = headers.get("www-authenticate")
        retry_after = headers.get("retry-after")
        self.wait = int(retry_after) if retry_after else None


def _view_scopes(request: Any, view: Any) -> tuple[str, ...] | None:
    return None if view is None else required_scopes(view, request.method)


class APIKeyAuthentication(BaseAuthentication):  # type: ignore[misc]
    """Authenticate `Authorization: Bearer <key>` (or the `HEADER` setting's header).

    Returns `(APIKeyUser, APIKeyAuth)`; the view reads the `KeyRecord` as `request.apikey`,
    as behind the middleware (`request.user.record` is the same record), and its grants as
    `request.auth.scopes`. A request without the header is anonymous (None), and so is one
    whose Authorization names a scheme this class does not read (neither Bearer nor a
    `LEGACY_SCHEMES` one): the view's next authentication class reads it, so
    `authentication_classes = [APIKeyAuthentication, OldAPIKeyAuthentication]` serves both
    while a migration lasts. The
    view's `required_scopes` are checked before credits are spent, as the middleware checks
    its scope table; a refusal raises `APIKeyRefused`.
    """

    def authenticate(self, request: Any) -> tuple[APIKeyUser, APIKeyAuth] | None:
        view = (getattr(request, "parser_context", None) or {}).get("view")
        required = _view_scopes(request, view) or ()
        outcome = check_request(request._request, required)
        if outcome is None:
            return None
        if not outcome.passed:
            raise APIKeyRefused(outcome.refusal())
        return _principal(outcome)

    def authenticate_header(self, request: Any) -> str:
        """The challenge of a 401: `Bearer realm="api"`."""
        realm = current_realm().replace("\\", "\\\\").replace('"', '\\"')
        return f'Bearer realm="{realm}"'


def _principal(outcome: Outcome) -> tuple[APIKeyUser, APIKeyAuth]:
    if outcome.record is None or outcome.auth is None:  # pragma: no cover - a passed key
        raise APIKeyRefused(Refusal.of(MissingAPIKey(), current_realm()))
    return APIKeyUser(outcome.record), outcome.auth


class HasScopes(BasePermission):  # type: ignore[misc]
    """Allow a request authenticated by an API key whose grants cover the view's
    `required_scopes` (`[]` for any key). A request without a key is refused with 401
    `missing_api_key`; a view that declares no `required_scopes` is a configuration error,
    never an open door."""

    def has_permission(self, request: Any, view: Any) -> bool:
        required = _view_scopes(request, view)
        if required is None:
            raise ImproperlyConfigured(
                f"{type(view).__name__} uses HasScopes and declares no required_scopes: "
                "set required_scopes = ['resource:action'] (or [] for any key)"
            )
        auth = request.auth
        if not isinstance(auth, APIKeyAuth):
            raise APIKeyRefused(Refusal.of(MissingAPIKey(), current_realm()))
        if required and not cast("GrantedScopes", auth.scopes).covers(required):
            # Checked already when the key was authenticated here; this is for keys the
            # middleware admitted or another authentication class let through.
            outcome = check_request(request._request, required)
            if outcome is not None and not outcome.passed:
                raise APIKeyRefused(outcome.refusal())
        return True


def exception_handler(exc: Exception, context: dict[str, Any]) -> Any:
    """DRF's `EXCEPTION_HANDLER`: apikeys refusals as the middleware's exact problem+json
    responses (with their RateLimit headers); anything else as DRF's default handler does."""
    if isinstance(exc, APIKeyRefused):
        response: HttpResponse = exc.refusal.response()
        return response
    # Imported here: rest_framework.views imports the authentication classes of the
    # settings (this module's) while it is itself being imported.
    from rest_framework.views import exception_handler as drf_exception_handler

    return drf_exception_handler(exc, context)
