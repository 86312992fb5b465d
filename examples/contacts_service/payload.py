"""Request bodies: read JSON within limits, and validate a new contact.

Refusals, in the order they are checked: 415 not JSON, 413 too large (counted while
reading, whatever `Content-Length` says), 400 not parseable, 422 invalid fields (every
field error at once). Nothing is stored unless all checks pass.
"""

from __future__ import annotations

import json
import re
from typing import Any

import phonenumbers
from email_validator import EmailNotValidError, validate_email
from starlette.requests import ClientDisconnect, Request

from examples.contacts_service.problems import FieldError, Problem

__all__ = [
    "MAX_BODY_BYTES",
    "media_type_is_json",
    "parse_json",
    "read_body",
    "read_json",
    "validate_contact",
]

MAX_BODY_BYTES = 64 * 1024
NAME_MAX = 200
COMPANY_MAX = 200
PHONE_MAX = 32
EMAIL_MAX = 254
CONTACT_FIELDS = frozenset({"name", "phone", "email", "company"})

# Control characters break logs and CSV exports, PostgreSQL refuses NUL, and lone
# surrogates cannot be encoded: none belongs in a name.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def media_type_is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media_type, *params = content_type.split(";")
    if media_type.strip().lower() != "application/json":
        return False
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            return False
    return True


def _refuse_constant(value: str) -> Any:
    raise ValueError(f"{value} is not JSON")


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate member names")
    return result


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's raw body, or `Problem.payload_too_large` (413) past `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise Problem.payload_too_large(limit)
    body = bytearray()
    # Counted as it arrives: a chunked body has no Content-Length to trust.
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise Problem.payload_too_large(limit)
    except ClientDisconnect:
        # The client left: a 400 to no one, not an error logged with its traceback.
        raise Problem.malformed_json("was cut off before it arrived whole") from None
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """`body` as UTF-8 JSON (no NaN or Infinity, no duplicate members), else a 400 `Problem`."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Problem.malformed_json("is not UTF-8") from None
    try:
        return json.loads(
            text, parse_constant=_refuse_constant, object_pairs_hook=_refuse_duplicates
        )
    except (ValueError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise Problem.malformed_json(f"is not valid JSON: {reason}") from None


async def read_json(request: Request, limit: int = MAX_BODY_BYTES) -> Any:
    """The request's JSON body, or the matching `Problem` (415, 413 or 400)."""
    if not media_type_is_json(request.headers.get("content-type")):
        raise Problem.unsupported_media_type()
    return parse_json(await read_body(request, limit))


def _text(
    errors: list[FieldError],
    field: str,
    value: object,
    maximum: int,
    *,
    required: bool = False,
    strip: bool = True,
) -> str | None:
    """A string field, or None when it is absent or null (or blank, for optional ones).

    Lengths count the characters sent, as the document's `maxLength` does; `strip` then
    trims surrounding whitespace.
    """
    if value is None:
        if required:
            errors.append({"field": field, "message": "is required"})
        return None
    if not isinstance(value, str):
        errors.append({"field": field, "message": "must be a string"})
        return None
    if len(value) > maximum:
        errors.append({"field": field, "message": f"must be at most {maximum} characters"})
        return None
    if _UNPRINTABLE.search(value):
        errors.append({"field": field, "message": "must not contain control characters"})
        return None
    if not strip:
        return value
    value = value.strip()
    if not value:
        if required:
            errors.append({"field": field, "message": "must not be blank"})
        return None
    return value


def _phone(errors: list[FieldError], value: str | None) -> str | None:
    if value is None:
        return None
    if not value.startswith("+"):
        errors.append(
            {
                "field": "phone",
                "message": "must be in international format: '+', country code and number, "
                "e.g. +14155552671",
            }
        )
        return None
    try:
        number = phonenumbers.parse(value, None)
    except phonenumbers.NumberParseException:
        number = None
    if number is None or not phonenumbers.is_valid_number(number):
        errors.append({"field": "phone", "message": "is not a valid phone number"})
        return None
    return str(phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164))


def _email(errors: list[FieldError], value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_email(value, check_deliverability=False).normalized
    except (EmailNotValidError, ValueError) as exc:
        errors.append({"field": "email", "message": f"is not a valid e-mail address: {exc}"})
        return None


def validate_contact(data: Any) -> dict[str, str | None]:
    """The contact to store (normalised), or `Problem.validation_failed` with every error.

    `name` is required (1 to 200 characters, trimmed, not blank); `phone` (E.164, stored
    normalised, e.g. `+14155552671`), `email` (stored normalised) and `company` (at most
    200 characters, trimmed; blank is null) may be omitted or null. Any other member is
    refused.
    """
    if not isinstance(data, dict):
        raise Problem.validation_failed([{"field": "body", "message": "must be a JSON object"}])
    errors: list[FieldError] = [
        {"field": field, "message": "is not a contact field"}
        for field in data
        if field not in CONTACT_FIELDS
    ]
    name = _text(errors, "name", data.get("name"), NAME_MAX, required=True)
    phone = _phone(errors, _text(errors, "phone", data.get("phone"), PHONE_MAX, strip=False))
    email = _email(errors, _text(errors, "email", data.get("email"), EMAIL_MAX, strip=False))
    company = _text(errors, "company", data.get("company"), COMPANY_MAX)
    if errors:
        raise Problem.validation_failed(errors)
    return {"name": name, "phone": phone, "email": email, "company": company}
