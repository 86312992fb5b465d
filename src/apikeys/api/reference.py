"""The management API's reference page, in Markdown, written from its OpenAPI document
alone: every operation with its scope, parameters, body fields and answers, then every
schema the answers name. An operation added to the API is on the page the next time it is
written, and the page says nothing the document does not.

```shell
python -m apikeys.api.reference --output docs/reference/management-api.md
python -m apikeys.api.reference --check docs/reference/management-api.md
```

The first writes the page (without `--output`, to standard output); the second exits 1
if the page is not what the document says now, as the test suite checks.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

__all__ = ["main", "markdown_reference"]

_METHODS: Final = ("get", "put", "post", "patch", "delete")
_REF: Final = "#/components/schemas/"


def _cell(text: object) -> str:
    """`text` as one table cell: on one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _type(schema: Mapping[str, Any]) -> str:
    """What a value of `schema` is, in a few words (a schema it names is a link)."""
    if "$ref" in schema:
        name = str(schema["$ref"]).removeprefix(_REF)
        return f"[`{name}`](#{_anchor(name)})"
    if "allOf" in schema:
        return " and ".join(_type(part) for part in schema["allOf"])
    kinds = schema.get("type")
    if kinds is None:
        return "any"
    words = []
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind == "array":
            words.append(f"array of {_type(schema.get('items', {}))}")
        elif kind == "string" and "format" in schema:
            words.append(f"string ({schema['format']})")
        else:
            words.append(str(kind))
    return " or ".join(words)


def _bounds(schema: Mapping[str, Any]) -> list[str]:
    """The values `schema` takes, beyond its type."""
    bounds = []
    if "enum" in schema:
        shown = ", ".join(f"`{value}`" for value in schema["enum"] if value is not None)
        bounds.append(f"one of {shown}")
    if "maxLength" in schema:
        bounds.append(f"{schema.get('minLength', 0)} to {schema['maxLength']} characters")
    if "maximum" in schema and "minimum" in schema:
        bounds.append(f"from {schema['minimum']} to {schema['maximum']}")
    elif "maximum" in schema:
        bounds.append(f"at most {schema['maximum']}")
    elif "minimum" in schema:
        bounds.append(f"at least {schema['minimum']}")
    if "pattern" in schema:
        bounds.append(f"matches `{schema['pattern']}`")
    if "maxItems" in schema:
        bounds.append(f"at most {schema['maxItems']} entries")
    items = schema.get("items")
    if isinstance(items, Mapping) and (inner := _bounds(items)):
        bounds.append(f"each {'; '.join(inner)}")
    return bounds


def _about(schema: Mapping[str, Any]) -> str:
    parts = [str(schema["description"])] if schema.get("description") else []
    parts += _bounds(schema)
    return _cell("; ".join(parts))


def _fields(schema: Mapping[str, Any]) -> Iterator[str]:
    """A table of an object schema's fields (with those of the schemas it extends)."""
    yield "| field | type | required | what it is |"
    yield "|---|---|---|---|"
    required = set(schema.get("required", ()))
    properties: Mapping[str, Any] = schema.get("properties", {})
    for name, field in properties.items():
        needed = "yes" if name in required else "no"
        yield f"| `{name}` | {_cell(_type(field))} | {needed} | {_about(field)} |"


def _parameters(parameters: Sequence[Mapping[str, Any]]) -> Iterator[str]:
    yield "| parameter | in | required | type | what it takes |"
    yield "|---|---|---|---|---|"
    for parameter in parameters:
        schema = parameter.get("schema", {})
        needed = "yes" if parameter.get("required") else "no"
        about = _cell("; ".join([*filter(None, [parameter.get("description")]), *_bounds(schema)]))
        yield (
            f"| `{parameter['name']}` | {parameter['in']} | {needed} | "
            f"{_cell(_type(schema))} | {about} |"
        )


def _answers(responses: Mapping[str, Any]) -> Iterator[str]:
    yield "| status | when | body |"
    yield "|---|---|---|"
    for status, response in responses.items():
        bodies = [
            f"{_type(media.get('schema', {}))} (`{content_type}`)"
            for content_type, media in response.get("content", {}).items()
        ]
        yield (
            f"| `{status}` | {_cell(response.get('description', ''))} | "
            f"{_cell(', '.join(bodies) or 'none')} |"
        )


def _scope(operation: Mapping[str, Any]) -> str:
    """The scopes an operation's security requirement names (what the caller must hold)."""
    found = dict.fromkeys(
        str(scope)
        for requirement in operation.get("security", ())
        for scopes in requirement.values()
        for scope in scopes
    )
    return " and ".join(f"`{scope}`" for scope in found) or "none"


def _operations(document: Mapping[str, Any]) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    for path, item in document.get("paths", {}).items():
        for method in _METHODS:
            if method in item:
                yield method.upper(), path, item[method]


def _operation(method: str, path: str, operation: Mapping[str, Any]) -> Iterator[str]:
    yield f"### `{method} {path}` {{ #{operation['operationId']} }}"
    yield ""
    yield f"{_cell(operation.get('summary', ''))}. {_cell(operation.get('description', ''))}"
    parameters = operation.get("parameters", [])
    if parameters:
        yield ""
        yield from _parameters(parameters)
    body = operation.get("requestBody")
    if body is not None:
        for content_type, media in body.get("content", {}).items():
            schema = media.get("schema", {})
            required = "required" if body.get("required") else "optional"
            yield ""
            if schema.get("properties"):
                yield f"The body, `{content_type}` ({required}), an object of these fields:"
                yield ""
                yield from _fields(schema)
            elif body.get("required"):
                yield f"The body, `{content_type}`: {_type(schema)}."
            else:
                yield "No body, or an empty JSON object (`{}`)."
    yield ""
    yield from _answers(operation.get("responses", {}))
    yield ""


def _schema(name: str, schema: Mapping[str, Any]) -> Iterator[str]:
    yield f"### `{name}` {{ #{_anchor(name)} }}"
    yield ""
    extends = [part for part in schema.get("allOf", []) if "$ref" in part]
    if extends:
        shown = ", ".join(_type(part) for part in extends)
        yield f"The fields of {shown}, and these:"
        yield ""
    yield from _fields(schema)
    yield ""


def markdown_reference(document: Mapping[str, Any]) -> str:
    """The reference page of the management API that `document` (an OpenAPI 3.1 document,
    `ManagementAPI(...).document`) describes, in Markdown."""
    info = document.get("info", {})
    operations = list(_operations(document))
    lines = [
        f"# {info.get('title', 'API')} reference",
        "",
        "<!-- Written by `python -m apikeys.api.reference --output "
        "docs/reference/management-api.md` from the API's OpenAPI document: change the code, "
        "not this page. -->",
        "",
        _cell(info.get("description", "")),
        "",
        "Paths are relative to where the API is mounted (`/v1/api-keys` in the "
        "[management API guide](../management-api.md)). A call sends a key of the workspace "
        "as `Authorization: Bearer <key>`; `GET /openapi.json` needs none and answers this "
        "page's document. Refusals are `application/problem+json` bodies, "
        "[`Problem`](#schema-problem), with the codes of the [HTTP errors](../http-errors.md).",
        "",
        "## Operations",
        "",
        "| operation | scopes | what it does |",
        "|---|---|---|",
    ]
    for method, path, operation in operations:
        link = f"[`{method} {path}`](#{operation['operationId']})"
        lines.append(f"| {link} | {_scope(operation)} | {_cell(operation.get('summary', ''))} |")
    lines.append("")
    for method, path, operation in operations:
        lines.extend(_operation(method, path, operation))
    lines += ["## Schemas", ""]
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        lines.extend(_schema(name, schema))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m apikeys.api.reference [--output PATH | --check PATH]`: write the page of
    the management API's document, or check a page is that; the exit status."""
    from apikeys.api.openapi import openapi_document

    parser = argparse.ArgumentParser(
        prog="python -m apikeys.api.reference",
        description="Write the management API's reference page from its OpenAPI document.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--output", type=Path, help="write the page here (default: stdout)")
    where.add_argument("--check", type=Path, help="exit 1 unless this page is up to date")
    args = parser.parse_args(argv)
    page = markdown_reference(openapi_document(title="Management API"))
    if args.check is not None:
        if not args.check.exists() or args.check.read_text() != page:
            print(f"{args.check} is out of date: run {parser.prog} --output {args.check}")
            return 1
        return 0
    if args.output is not None:
        args.output.write_text(page)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
