"""A contacts and campaigns API whose `/api/v1/` endpoints are protected by API keys.

```shell
python -m uvicorn examples.contacts_service.app:app --no-proxy-headers
```

- `settings.py`: configuration from the environment.
- `db.py`: the service's own tables (SQLAlchemy Core) and every query, per workspace.
- `payload.py`: reading JSON bodies within limits, and validating a new contact.
- `problems.py`: the service's own errors, as problem+json like the middleware's.
- `api.py`: the endpoints and the scope each one needs.
- `leaks.py`: the library's leak endpoints, routed: `/api/v1/secret-scanning` (GitHub's
  signed secret scanning alerts: the keys found in public are revoked, or disabled) and
  `/api/v1/credentials/revoke` (anyone may report leaked keys).
- `openapi.py`: the OpenAPI 3.1 document served at `/api/v1/openapi.json`.
- `auth.py`: the settings UI's users (passlib argon2), sessions, CSRF tokens, login throttle.
- `web.py`, `templates/`: `/login`, `/logout`, and the library's settings page
  (`apikeys.ui.KeysPage`) mounted at `/settings/integrations/api-keys/`.
- `app.py`: puts it together; `app` is what uvicorn serves.

Importing this package has no side effects; only `app` reads the environment.
"""
