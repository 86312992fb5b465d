"""Framework integrations: `apikeys.integrations.starlette` and `apikeys.integrations.fastapi`.

Each is imported on its own, so that using one never imports the other's framework.
"""

from __future__ import annotations

__all__: list[str] = []
