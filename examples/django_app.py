"""A Django project behind `APIKeyMiddleware`: the middleware wraps Django's ASGI application.

```shell
APIKEYS_PEPPER=… uvicorn examples.django_app:application --no-proxy-headers
```

Django's views read the key from the ASGI scope (`request.scope["apikey"]`, the
`KeyRecord`); the middleware has already checked it, its scope and its rate limit, and
answered every refusal with problem+json before Django saw the request. Django does not speak
the ASGI lifespan protocol, so the middleware speaks it for it: usage counts are still
written when the server stops.
"""

from __future__ import annotations

import os
import secrets

import django
from django.conf import settings

settings.configure(
    DEBUG=False,
    SECRET_KEY=os.environ.get("DJANGO_SECRET_KEY") or secrets.token_urlsafe(32),
    ROOT_URLCONF=__name__,
    ALLOWED_HOSTS=["*"],
    INSTALLED_APPS=[],
    MIDDLEWARE=[],
)
django.setup()

from django.core.asgi import get_asgi_application  # noqa: E402 - after settings
from django.http import HttpRequest, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402

from apikeys import APIKeyMiddleware, KeyManager  # noqa: E402

__all__ = ["application", "manager"]


def contacts(request: HttpRequest) -> JsonResponse:
    key = request.scope["apikey"]  # type: ignore[attr-defined]
    return JsonResponse({"workspace": key.workspace, "key": key.id, "data": []})


urlpatterns = [path("api/v1/contacts", contacts)]

manager = KeyManager(os.environ.get("APIKEYS_STORE_URL", "sqlite:///apikeys.db"))
application = APIKeyMiddleware(
    get_asgi_application(),
    manager=manager,
    scopes={"GET /api/v1/contacts": "contacts:read"},
    protect="/api/",
)
