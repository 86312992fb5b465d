"""The key store's tables, made at `manage.py migrate` (the store's `setup()`).

apikeys keeps its keys in the store `APIKEYS["STORE_URL"]` names, which need not be Django's
database (Redis, another PostgreSQL), so it has no Django models: this migration runs the
store's own `setup()`, idempotent, once (for the `default` database alias), and checks the
pepper as the server will. Reversing it keeps the keys: it drops nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import DEFAULT_DB_ALIAS, migrations


def set_up_store(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.alias != DEFAULT_DB_ALIAS:
        return
    from apikeys.integrations.django import get_manager

    get_manager().setup()


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    atomic = False  # the store has its own connection: nothing to hold Django's open for
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(set_up_store, migrations.RunPython.noop, elidable=False),
    ]
