"""The API keys settings page, as an ASGI app to mount in any Starlette-style application.

```python
from apikeys.ui import KeysPage, PageUser

async def current_user(request):        # your login: who is looking at the page, or None
    user = await my_session_user(request)
    return PageUser(id=user.id, workspace=user.team, name=user.email) if user else None

keys_page = KeysPage(manager, user=current_user, secret_key=SECRET, login_url="/login",
                     scopes={"contacts:read": "List and read contacts"})
app.mount("/settings/api-keys", keys_page)   # Starlette; FastAPI: app.mount(...) too
```

Needs the `ui` extra: `pip install 'apikeys[ui]'` (Jinja2 and itsdangerous).
"""

from __future__ import annotations

from apikeys.ui.onetime import Reveal, RevealStore
from apikeys.ui.page import KeysPage
from apikeys.ui.request import PageUser, UserHook

__all__ = ["KeysPage", "PageUser", "Reveal", "RevealStore", "UserHook"]
