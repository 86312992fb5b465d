"""Framework integrations: `apikeys.integrations.starlette`, `apikeys.integrations.fastapi` and
`apikeys.integrations.django` (a Django middleware and Django REST framework classes).

Each is imported on its own, so that using one never imports the other's framework.
"""

from __future__ import annotations

__all__: list[str] = []
