"""A Django project in one file whose API is authenticated by API keys.

```shell
export APIKEYS_PEPPER=… APIKEYS_STORE_URL=sqlite:///apikeys.db
python -m examples.django_app create-key acme contacts:read notes:read   # prints a key
uvicorn examples.django_app:application --no-proxy-headers              # over ASGI
gunicorn examples.django_app:wsgi_application                             # or over WSGI
```

- `apikeys.integrations.django.APIKeyMiddleware` protects `/api/` with the scope table of
  `APIKEYS["SCOPES"]`, exactly as `APIKeyMiddleware` protects an ASGI app: plain Django
  views read the key from `request.apikey`.
- `/rest/v1/notes` is a Django REST framework view: `APIKeyAuthentication` and `HasScopes`
  check the scopes the view declares (`required_scopes`, by method), and refusals are the
  same problem+json responses (`exception_handler`); it reads the key as `request.apikey`
  too.
- `apikeys.integrations.django` in `INSTALLED_APPS` adds the system checks and
  `manage.py apikeys …` of a project with a `manage.py`.
- `create-key` is what a management command would do: `get_manager()` is the synchronous
  manager on the same store, no `asyncio.run` in sight.

The store is the one the `apikeys` command line uses (`APIKEYS_STORE_URL`, pepper from
`APIKEYS_PEPPER`). Usage counts are written as the process exits.
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any, ClassVar

import django
from django.conf import settings

settings.configure(
    DEBUG=False,
    SECRET_KEY=os.environ.get("DJANGO_SECRET_KEY") or secrets.token_urlsafe(32),
    ROOT_URLCONF=__name__,
    ALLOWED_HOSTS=["*"],
    INSTALLED_APPS=[
        "django.contrib.contenttypes",
        "django.contrib.auth",
        "rest_framework",
        "apikeys.integrations.django",
    ],
    DATABASES={},
    MIDDLEWARE=["apikeys.integrations.django.APIKeyMiddleware"],
    APIKEYS={
        "PROTECT": "/api/",
        "SCOPES": {"GET /api/v1/contacts": "contacts:read"},
    },
    REST_FRAMEWORK={
        "DEFAULT_AUTHENTICATION_CLASSES": ["apikeys.integrations.django.APIKeyAuthentication"],
        "DEFAULT_PERMISSION_CLASSES": ["apikeys.integrations.django.HasScopes"],
        "EXCEPTION_HANDLER": "apikeys.integrations.django.exception_handler",
        "UNAUTHENTICATED_USER": None,
    },
)
django.setup()

from django.core.asgi import get_asgi_application  # noqa: E402 - after settings
from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.http import HttpRequest, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402
from rest_framework.request import Request  # noqa: E402
from rest_framework.response import Response  # noqa: E402
from rest_framework.views import APIView  # noqa: E402

from apikeys.integrations.django import get_manager  # noqa: E402

__all__ = ["NoteList", "application", "contacts", "main", "wsgi_application"]


def contacts(request: HttpRequest) -> JsonResponse:
    """`GET /api/v1/contacts`: the middleware checked the key and its `contacts:read`."""
    key = request.apikey  # type: ignore[attr-defined]
    return JsonResponse({"workspace": key.workspace, "key": key.id, "data": []})


class NoteList(APIView):
    """`/rest/v1/notes`: reading needs `notes:read`, writing `notes:write`."""

    required_scopes: ClassVar[dict[str, list[str]]] = {
        "GET": ["notes:read"],
        "POST": ["notes:write"],
    }
    notes: ClassVar[dict[str, list[Any]]] = {}

    def get(self, request: Request) -> Response:
        workspace = request.apikey.workspace
        return Response({"workspace": workspace, "data": self.notes.get(workspace, [])})

    def post(self, request: Request) -> Response:
        workspace = request.apikey.workspace
        self.notes.setdefault(workspace, []).append(request.data)
        return Response({"workspace": workspace, "saved": request.data}, status=201)


urlpatterns = [
    path("api/v1/contacts", contacts),
    path("rest/v1/notes", NoteList.as_view()),
]

application = get_asgi_application()
wsgi_application = get_wsgi_application()


def main(argv: list[str]) -> int:
    """`create-key WORKSPACE SCOPE...`: issue a key and print it (shown only this once)."""
    if len(argv) < 3 or argv[0] != "create-key":
        print("usage: python -m examples.django_app create-key WORKSPACE SCOPE...")
        return 2
    created = get_manager().create(name="example", workspace=argv[1], scopes=argv[2:])
    print(created.key)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
