"""A tiny notes API protected by apikeys: the app a user of apikeys would test.

```python
app = create_app(KeyManager(store_from_url("sqlite:///apikeys.db")))
```
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, KeyManager

NOTES: dict[str, list[str]] = {}


async def list_notes(request: Request) -> JSONResponse:
    workspace = request.scope["apikey"].workspace
    return JSONResponse({"data": NOTES.get(workspace, [])})


async def add_note(request: Request) -> JSONResponse:
    workspace = request.scope["apikey"].workspace
    note = (await request.body()).decode("utf-8", "replace")[:200]
    NOTES.setdefault(workspace, []).append(note)
    return JSONResponse({"note": note}, status_code=201)


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def create_app(manager: KeyManager, *, rate_limit: str = "100/minute") -> APIKeyMiddleware:
    """The notes API: `/api/v1/notes` needs a key, `/health` does not."""
    inner = Starlette(
        routes=[
            Route("/api/v1/notes", list_notes, methods=["GET"]),
            Route("/api/v1/notes", add_note, methods=["POST"]),
            Route("/health", health),
        ]
    )
    return APIKeyMiddleware(
        inner,
        manager=manager,
        scopes={"GET /api/v1/notes": "notes:read", "POST /api/v1/notes": "notes:write"},
        protect="/api/",
        rate_limit=rate_limit,
    )
