"""The `apikeys` command line: create, list, show, disable, enable, revoke, roll and scan keys.

```
apikeys create --name Zapier --workspace acme --scope contacts:read --expires-in 90d
apikeys list --workspace acme
apikeys roll 3xK9pQ2mZ7aB --grace 24h
apikeys revoke 3xK9pQ2mZ7aB --yes
apikeys scan . --revoke
apikeys import --from drf-api-key postgresql://localhost/django --full-access
apikeys identities create acme --workspace acme --rate-limit 1000/hour
apikeys create --name Zapier --workspace acme --full-access --identity acme
```

The store is `--store URL` or `APIKEYS_STORE_URL` (default `sqlite:///apikeys.db`, the one
the example service uses). Keys are hashed with `APIKEYS_PEPPER`: give the command line the
same pepper as the service, or the service will not recognise the keys created here.

Exit status: 0 done, 1 refused (unknown id, enabling a revoked key, store unreachable, a key
found by `scan`) with a one-line reason on stderr, 2 usage error. A key made by `create` or
`roll` that the store's replicas did not confirm is printed all the same, with a warning on
stderr, and exits 0. A full key is printed only by `create` and `roll`, once; every other
output shows the masked form `ak_<id>_…`.
"""

from __future__ import annotations

from apikeys.cli import (  # noqa: F401 - importing them adds their commands
    audit,
    identities,
    importing,
    keys,
    migration,
    scan,
    usage,
    webhooks,
)
from apikeys.cli.common import main

__all__ = ["main"]

if __name__ == "__main__":  # pragma: no cover - `python -m apikeys.cli`
    main(prog_name="apikeys")
