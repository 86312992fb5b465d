"""Importing keys from other systems, keeping their hashes (`apikeys import`).

```python
from apikeys.importing import import_keys, read_csv, read_drf, write_revocations
```

`read_drf(url)` reads djangorestframework-api-key's table, `read_csv(path)` a file of
`name,hash[,expires_at][,prefix]` rows; `import_keys(manager, rows, …)` makes each row a
record of apikeys that keeps the old hash. The old key strings then work as they are, and
are re-hashed with apikeys' own scheme on their first successful use (audit `rehashed`).
How their records are found without giving away which keys exist: `apikeys.importing.foreign`.
While a migration lasts, `write_revocations(manager, url, workspace=…)` marks revoked in
djangorestframework-api-key's table the keys imported from it and revoked in apikeys since,
so the old service refuses them too (`apikeys sync-revocations`).
"""

from __future__ import annotations

from apikeys.importing.revocations import RevocationReport, write_revocations
from apikeys.importing.run import ImportReport, import_keys
from apikeys.importing.sources import DRF_TABLE, ForeignKey, Refusal, read_csv, read_drf

__all__ = [
    "DRF_TABLE",
    "ForeignKey",
    "ImportReport",
    "Refusal",
    "RevocationReport",
    "import_keys",
    "read_csv",
    "read_drf",
    "write_revocations",
]
