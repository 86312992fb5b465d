"""What the leak endpoints share: reading a JSON body within limits, and answering.

Both endpoints are pure ASGI apps that answer every refusal themselves, as problem+json
(`apikeys.problems`), so they work mounted in any application, whatever its error
handlers. A body is counted as it arrives (a chunked body has no `Content-Length` to
trust), decoded as UTF-8 and parsed strictly: no NaN or Infinity, no duplicate members.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from apikeys.bounds import check_json_text
from apikeys.errors import (
    InvalidKeyParameters,
    MalformedJSON,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from apikeys.types import Receive, Send

__all__ = ["header", "header_values", "parse_json", "read_body", "require_json", "send_json"]


def header_values(scope: Mapping[str, Any], name: bytes) -> list[str]:
    """Every value of the header `name` (lower case), decoded as latin-1, in order."""
    return [
        value.decode("latin-1") for key, value in scope.get("headers") or () if key.lower() == name
    ]


def header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """The first value of the header `name` (lower case), or None."""
    values = header_values(scope, name)
    return values[0] if values else None


def require_json(scope: Mapping[str, Any]) -> None:
    """Raise `UnsupportedMediaType` unless the body is declared `application/json` (UTF-8)."""
    content_type = header(scope, b"content-type")
    if not content_type:
        raise UnsupportedMediaType()
    media_type, *params = content_type.split(";")
    if media_type.strip().lower() != "application/json":
        raise UnsupportedMediaType()
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            raise UnsupportedMediaType()


async def read_body(scope: Mapping[str, Any], receive: Receive, limit: int) -> bytes:
    """The request's raw body, or `PayloadTooLarge` past `limit` bytes."""
    declared = header(scope, b"content-length") or ""
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(limit)
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        body += message.get("body", b"")
        if len(body) > limit:
            raise PayloadTooLarge(limit)
        if not message.get("more_body", False):
            break
    return bytes(body)


def _refuse_constant(value: str) -> Any:
    raise ValueError(f"{value} is not JSON")


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate member names")
    return result


def parse_json(body: bytes) -> Any:
    """`body` as UTF-8 JSON, or `MalformedJSON`."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedJSON("The request body is not UTF-8.") from None
    try:
        check_json_text(text, "the request body")
    except InvalidKeyParameters as exc:
        raise MalformedJSON(f"The request body is not acceptable JSON: {exc}.") from None
    try:
        return json.loads(
            text, parse_constant=_refuse_constant, object_pairs_hook=_refuse_duplicates
        )
    except ValueError as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise MalformedJSON(f"The request body is not valid JSON: {reason}.") from None


async def send_json(send: Send, status: int, document: Any) -> None:
    """A complete JSON response that no cache keeps."""
    body = json.dumps(document, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
