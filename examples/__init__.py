"""Runnable examples of apikeys. Run them from the repository root.

- `contacts_service`: a Starlette contacts and campaigns API protected by `APIKeyMiddleware`
  (`python -m uvicorn examples.contacts_service.app:app --no-proxy-headers`).
- `demo`: seeds a demo workspace, prints a fresh key and serves the contacts service
  (`python -m examples.demo`, what `make demo` runs).
- `django_app`: a Django project in one file, with the apikeys Django middleware, Django REST
  framework classes and the synchronous manager (`python -m examples.django_app create-key
  acme contacts:read`, then `uvicorn examples.django_app:application --no-proxy-headers`).
"""
