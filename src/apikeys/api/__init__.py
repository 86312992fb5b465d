"""`apikeys.api`: the management API, JSON over HTTP for a workspace's keys, identities,
usage and audit trail, and (operators only) webhooks, with an OpenAPI 3.1 document at
`/openapi.json`.

```python
from starlette.applications import Starlette
from starlette.routing import Mount

from apikeys.api import ManagementAPI

app = Starlette(routes=[Mount("/v1/api-keys", app=ManagementAPI(manager))])
```

A call is made with a key of the workspace it manages, holding `apikeys:read` (reads),
`apikeys:write` (changes keys) or `apikeys:admin` (changes identities). A caller never
makes or edits a key with more than it holds: the one rule of `apikeys.fields`, the settings
page's. Webhook endpoints and deliveries, of every workspace, are the operators': callers of
the workspaces `ManagementAPI(manager, operators=…)` names whose keys name `apikeys:admin`;
to anyone else their paths answer as paths that are no operation. Its parts, one job each:
`app` (the ASGI app), `operations` (the table of operations and scopes), `keys`,
`identities` and `webhooks` (the endpoints), `schemas` (bodies from the field tables),
`openapi` (the document), `merging` (its operations in another app's document, as
mounted: `apikeys.integrations.fastapi.include_management_api`), `reference` (its
reference page, in Markdown: `python -m apikeys.api.reference`), `idempotency`
(`Idempotency-Key`), `http` (what every endpoint shares).
"""

from __future__ import annotations

from apikeys.api.app import ManagementAPI
from apikeys.api.openapi import openapi_document
from apikeys.api.operations import ADMIN_SCOPE, OPERATIONS, READ_SCOPE, WRITE_SCOPE, Operation

__all__ = [
    "ADMIN_SCOPE",
    "OPERATIONS",
    "READ_SCOPE",
    "WRITE_SCOPE",
    "ManagementAPI",
    "Operation",
    "openapi_document",
]
