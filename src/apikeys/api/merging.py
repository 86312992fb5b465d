"""The management API's operations in another application's OpenAPI document, as mounted.

An app that mounts `ManagementAPI` at `/v1/api-keys` serves its operations there, but a
framework that writes the app's document from its own routes (FastAPI) does not see them.
`merge_document` adds them: each path under the mount's prefix, and the components its
operations use, without changing anything the app's document had. A component whose name
the app already gives to something else (its own `Problem`, a model called `Key`) joins
under a new name (`APIKeysProblem`), and every `$ref` and security requirement naming it is
rewritten; a component the app has word for word is shared. An `operationId` the app
already uses is renamed the same way (`apikeys_create_key`). The API's top-level `security`
goes onto each of its operations, since the app's own would apply to them otherwise; its
`info` stays the API's own.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from typing import Any, Final

from apikeys.errors import ConfigurationError

__all__ = ["RENAMED_PREFIX", "merge_document", "mount_prefix"]

RENAMED_PREFIX: Final = "APIKeys"
"""What a component of the management API whose name the app already uses is renamed with
(`Problem` becomes `APIKeysProblem`; an operationId `create_key`, `apikeys_create_key`)."""

_METHODS: Final = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def _free_name(name: str, taken: Collection[str], prefix: str) -> str:
    """`prefix` and `name` (`APIKeysProblem`, `APIKeysApiKey`, `apikeys_create_key`), with a
    number after it while that is taken too."""
    base = prefix + (name[:1].upper() + name[1:] if prefix[:1].isupper() else name)
    candidate = base
    number = 2
    while candidate in taken:
        candidate = f"{base}{number}"
        number += 1
    return candidate


def _component_renames(
    ours: Mapping[str, Any], theirs: Mapping[str, Any]
) -> dict[str, dict[str, str]]:
    """For each kind of component (`schemas`, `securitySchemes`, …), the names of `theirs`
    that must change to join `ours`: those `ours` holds with another value."""
    renames: dict[str, dict[str, str]] = {}
    for kind, named in theirs.items():
        held = ours.get(kind, {})
        taken = set(held) | set(named)
        kind_renames: dict[str, str] = {}
        for name, value in named.items():
            if name in held and held[name] != value:
                kind_renames[name] = new = _free_name(name, taken, RENAMED_PREFIX)
                taken.add(new)
        renames[kind] = kind_renames
    return renames


def _rewrite(node: Any, refs: Mapping[str, str]) -> Any:
    """A copy of `node` with every `$ref` that `refs` names pointing at its new name."""
    if isinstance(node, dict):
        rewritten = {key: _rewrite(value, refs) for key, value in node.items()}
        target = node.get("$ref")
        if isinstance(target, str) and target in refs:
            rewritten["$ref"] = refs[target]
        return rewritten
    if isinstance(node, list):
        return [_rewrite(item, refs) for item in node]
    return copy.deepcopy(node)


def _requirements(requirements: Any, schemes: Mapping[str, str]) -> list[dict[str, Any]]:
    return [
        {schemes.get(name, name): roles for name, roles in requirement.items()}
        for requirement in requirements
    ]


def _operation_ids(paths: Mapping[str, Any]) -> set[str]:
    return {
        operation["operationId"]
        for item in paths.values()
        for method, operation in item.items()
        if method in _METHODS and isinstance(operation, dict) and "operationId" in operation
    }


def mount_prefix(path: str) -> str:
    """The prefix of the paths of an app mounted at `path` (`/v1/api-keys/` gives
    `/v1/api-keys`, `/` gives ``), or a `ConfigurationError` for a path that takes
    parameters or does not start with `/`."""
    prefix = path
    if prefix and not prefix.startswith("/"):
        raise ConfigurationError(f"the management API's path must start with '/': {prefix!r}")
    if "{" in prefix or "}" in prefix:
        raise ConfigurationError(f"the management API's path takes no parameters: {prefix!r}")
    return prefix.rstrip("/")


def merge_document(
    target: dict[str, Any],
    document: Mapping[str, Any],
    prefix: str,
    *,
    tags: Collection[str] = (),
) -> None:
    """Add the operations of `document` (the management API's OpenAPI document) to `target`
    (an app's), each path under `prefix` (where the API is mounted, `/v1/api-keys`), with
    the components they use; each operation also gets `tags` (and `target` a tag object for
    each it lacks, described by the API's `info`).

    Nothing `target` held changes. A path `target` already has under `prefix` is a
    `ConfigurationError`: the app's route and the mount would answer the same requests.
    """
    prefix = mount_prefix(prefix)
    paths = target.setdefault("paths", {})
    ours = target.setdefault("components", {})
    renames = _component_renames(ours, document.get("components", {}))
    refs = {
        f"#/components/{kind}/{old}": f"#/components/{kind}/{new}"
        for kind, names in renames.items()
        for old, new in names.items()
    }
    schemes = renames.get("securitySchemes", {})
    for kind, named in document.get("components", {}).items():
        held = ours.setdefault(kind, {})
        for name, value in named.items():
            held.setdefault(renames[kind].get(name, name), _rewrite(value, refs))
    apps_ids = _operation_ids(paths)
    taken_ids = apps_ids | _operation_ids(document.get("paths", {}))
    default_security = _requirements(document.get("security", []), schemes)
    for path, item in document.get("paths", {}).items():
        full = prefix + path
        if full in paths:
            raise ConfigurationError(
                f"{full} is both a route of the app and an operation of the management API "
                f"mounted at {prefix or '/'}: give one of them another path"
            )
        merged = _rewrite(item, refs)
        for method, operation in merged.items():
            if method not in _METHODS:
                continue
            operation["security"] = _requirements(
                operation.get("security", default_security), schemes
            )
            if operation.get("operationId") in apps_ids:
                new_id = _free_name(operation["operationId"], taken_ids, "apikeys_")
                operation["operationId"] = new_id
                taken_ids.add(new_id)
            if tags:
                operation["tags"] = [*operation.get("tags", []), *tags]
        paths[full] = merged
    described = {tag.get("name") for tag in target.get("tags", [])}
    info = document.get("info", {})
    for tag in tags:
        if tag not in described:
            entry = {"name": tag, "description": info.get("description", "")}
            target.setdefault("tags", []).append(entry)
