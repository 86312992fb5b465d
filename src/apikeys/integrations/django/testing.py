"""Keys for the tests of a Django project: `make_key(...)` creates a key in the store of
`settings.APIKEYS` (`get_manager()`'s), in the state a test needs.

```python
created = make_key(scopes=["contacts:read"])
revoked = make_key(status="revoked")
```

It takes the arguments of the pytest plugin's `make_key` (`apikeys.testing.KeyFactory`):
`scopes` (none: full access), `full_access`, `rate_limit`, `status` (`active`,
`disabled`, `revoked`, `expired`), `workspace`, `name` and `expires_in`.
"""

from __future__ import annotations

from typing import Any

from apikeys.integrations.django import get_manager
from apikeys.testing.factory import KeyFactory
from apikeys.types import CreatedKey

__all__ = ["make_key"]


def make_key(**options: Any) -> CreatedKey:
    """A key in the store of `settings.APIKEYS`, made on its manager's event loop."""
    manager = get_manager()
    factory = KeyFactory(manager.manager)
    return manager.loop_thread.call(factory, **options)
