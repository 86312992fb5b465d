"""The `apikeys` command line on a store built with the test's own options.

The command line takes a store URL only; tests keep their data apart with a table or a key
prefix of their own (`APIKEYS_TEST_STORE_OPTIONS`, JSON keyword arguments of the store), so
this runs the very same `apikeys.cli.main` with those options added to every store it builds.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import apikeys.cli.common as cli
from apikeys.stores import store_from_url  # the same name in every release

OPTIONS: dict[str, Any] = json.loads(os.environ.get("APIKEYS_TEST_STORE_OPTIONS") or "{}")


def _store_from_url(url: str, **options: Any) -> Any:
    return store_from_url(url, **{**OPTIONS, **options})


cli.store_from_url = _store_from_url  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(cli.main())
