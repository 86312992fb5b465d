"""Reading the settings page's forms, and showing times: plain functions, no I/O but the body."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Final, NamedTuple
from urllib.parse import parse_qsl

from starlette.datastructures import ImmutableMultiDict
from starlette.requests import ClientDisconnect, Request

from apikeys.durations import MAX_DURATION, parse_duration
from apikeys.errors import InvalidKeyParameters
from apikeys.fields import KEY_FIELDS
from apikeys.policies import POLICY_PARSERS, dump_metadata
from apikeys.ratelimit import parse_policies
from apikeys.types import KeyField, KeyRecord, Kind, utcnow

__all__ = [
    "MAX_FORM_BYTES",
    "MAX_LABEL",
    "OPERATOR_FIELDS",
    "POLICY_FIELDS",
    "POLICY_INPUTS",
    "UNCHANGED",
    "Form",
    "FormRefused",
    "KeyForm",
    "PolicyInput",
    "exact",
    "iso",
    "parse_expiry",
    "read_form",
    "read_key_form",
    "read_policies",
    "relative",
    "requested_changes",
]

MAX_FORM_BYTES = 16 * 1024
MAX_LABEL = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")

Form = ImmutableMultiDict[str, str]
# The fields a form may send more than once: one value per checked box.
_REPEATABLE: Final = frozenset({"scopes"})


class FormRefused(Exception):
    """A body that is not one of the page's forms: answered with `status` and `title`."""

    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.title = title
        self.message = message


# -- showing times -------------------------------------------------------------------------

_UNITS = (
    ("year", 365 * 86400),
    ("month", 30 * 86400),
    ("day", 86400),
    ("hour", 3600),
    ("minute", 60),
    ("second", 1),
)


def relative(moment: datetime, now: datetime | None = None) -> str:
    """`3 minutes ago`, `in 23 hours`, `just now`."""
    seconds = ((now or utcnow()) - moment).total_seconds()
    if 0 <= seconds < 10:
        return "just now"
    span = abs(seconds)
    for unit, size in _UNITS:
        if span >= size or unit == "second":
            amount = int(span // size)
            text = f"{amount} {unit}{'' if amount == 1 else 's'}"
            return f"{text} ago" if seconds > 0 else f"in {text}"
    raise AssertionError("unreachable")  # pragma: no cover


def exact(moment: datetime) -> str:
    """`2026-01-31 12:00:00 UTC`."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(moment: datetime) -> str:
    """`2026-01-31T12:00:00Z`."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- reading forms -------------------------------------------------------------------------


async def read_form(request: Request) -> Form:
    """The posted form, read within `MAX_FORM_BYTES`; refused unless URL-encoded UTF-8,
    and with 400 when a field other than `scopes` is sent twice.

    An empty body without a content type is an empty form (which then fails the CSRF check).
    """
    refused = FormRefused(415, "Unsupported form", "This page accepts only its own forms.")
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type not in ("application/x-www-form-urlencoded", ""):
        raise refused
    too_large = FormRefused(413, "Form too large", "The form you sent is too large.")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                raise too_large
    except ClientDisconnect:
        # Answered to no one, but answered: not an error logged with its traceback, which
        # anyone could fill the logs with by cutting off a login form.
        raise FormRefused(400, "Form cut off", "The form did not arrive whole.") from None
    if not media_type and body:
        raise refused
    try:
        pairs = parse_qsl(
            body.decode("ascii"),
            keep_blank_values=True,
            max_num_fields=100,
            encoding="utf-8",
            errors="strict",
        )
    except (UnicodeDecodeError, ValueError):
        raise FormRefused(400, "Unreadable form", "The form you sent could not be read.") from None
    # One value per field but the scope checkboxes: a field sent twice is read one way here
    # and maybe another by a proxy or filter in front, so it is refused, not guessed at.
    names = [name for name, _ in pairs if name not in _REPEATABLE]
    if len(names) != len(set(names)):
        raise FormRefused(400, "Unreadable form", "The form you sent holds a field twice.")
    return ImmutableMultiDict(pairs)


def parse_expiry(text: str, now: datetime) -> datetime | None:
    """Empty: never. `30d`, `12h`…: from now. `2026-12-31`: the end of that day, UTC.

    `2026-12-31T18:00:00Z` (with a time zone): that moment.
    """
    text = text.strip()
    if not text:
        return None
    if _DATE.fullmatch(text):
        try:
            day = date.fromisoformat(text)
            moment = datetime.combine(day, time(0), tzinfo=UTC) + timedelta(days=1)
        except (ValueError, OverflowError):
            raise ValueError(f"{text} is not a date: write it as YYYY-MM-DD.") from None
    elif text[:1].isdigit() and "T" in text:
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{text} is not a date and time.") from None
        if moment.tzinfo is None:
            raise ValueError("Give the time zone, e.g. 2026-12-31T18:00:00Z.")
    else:
        try:
            return now + parse_duration(text)
        except ValueError:
            raise ValueError(
                "Write the expiry as a duration, like 30d, 12h or 2w, or as a date, "
                "like 2026-12-31."
            ) from None
    if moment <= now:
        raise ValueError("The expiry must be in the future.")
    if moment - now > MAX_DURATION:
        raise ValueError(f"The expiry must be within {MAX_DURATION.days} days.")
    return moment


class PolicyInput(NamedTuple):
    """How the page shows one policy field (`apikeys.policies.POLICY_PARSERS`)."""

    field: str
    label: str
    hint: str
    kind: str
    """`input` (one line) or `textarea` (lists and JSON)."""


# The page's words for the policy fields it has always had, in the order it shows them; any
# other policy field is shown after them, labelled after its name with its description.
_SPELLED: Final = (
    PolicyInput("owner", "Owner", "Who the key is for: a user id or an e-mail address.", "input"),
    PolicyInput("credits", "Credits", "Uses left, one per request. Empty: unlimited.", "input"),
    PolicyInput(
        "credit_refill",
        "Credit refill",
        "Set the credits back every UTC day or month: 1000/day, 5000/month.",
        "input",
    ),
    PolicyInput(
        "allowed_ips",
        "Allowed addresses",
        "IPv4 or IPv6 ranges, one per line (10.0.0.0/8). Empty: any address.",
        "textarea",
    ),
    PolicyInput(
        "metadata",
        "Metadata",
        "A JSON object for the application, at most 4 KiB. Never put a secret here.",
        "textarea",
    ),
)


def _derived_input(name: str) -> PolicyInput:
    field = KEY_FIELDS[name]
    wide = field.kind in (Kind.NAMES, Kind.OBJECT)
    hint = field.description[:1].upper() + field.description[1:] + "."
    if field.kind is Kind.NAMES:
        hint += " One per line."
    label = name.replace("_", " ").capitalize()
    return PolicyInput(name, label, hint, "textarea" if wide else "input")


POLICY_INPUTS: Final = (
    *_SPELLED,
    *(_derived_input(name) for name in POLICY_PARSERS if name not in {i.field for i in _SPELLED}),
)
"""Each policy field as the page shows it (the templates' `POLICY_INPUTS`)."""

POLICY_FIELDS: Final = tuple(POLICY_PARSERS)

_NAMED_ORDER: Final = ("rate_limit", "credits", "credit_refill", "allowed_ips", "owner", "metadata")
OPERATOR_FIELDS: Final = tuple(
    sorted(
        (("rate_limit", "rate limit"), *((i.field, i.label.lower()) for i in POLICY_INPUTS)),
        key=lambda pair: _NAMED_ORDER.index(pair[0]) if pair[0] in _NAMED_ORDER else 99,
    )
)
"""The fields the create form names as the operator's (unless the page gives them to its
users), with the words it uses: `(field, words)`."""


def _form_text(field: KeyField, value: Any) -> str:
    """A policy field's value as its form shows it (empty: not set)."""
    if value is None:
        return ""
    if field.kind is Kind.NAMES:
        return "\n".join(value)
    if field.kind is Kind.OBJECT:
        return dump_metadata(value) if value else ""
    return str(value)


@dataclass(frozen=True, slots=True)
class KeyForm:
    """What the create and edit forms hold, as typed (shown again when refused).

    The policy fields' texts are in `policies`, and read as attributes too (`form.owner`);
    a list (`allowed_ips`) is one item per line, or separated by commas or spaces.
    """

    name: str = ""
    access: str = "restricted"
    scopes: tuple[str, ...] = ()
    rate_limit: str = ""
    expires: str = ""
    policies: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __getattr__(self, name: str) -> str:
        if name in POLICY_PARSERS:
            return self.policies.get(name, "")
        raise AttributeError(name)

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)

    @classmethod
    def of(cls, record: KeyRecord) -> KeyForm:
        """The edit form of `record`, filled in with what it is now."""
        return cls(
            name=record.name,
            access=record.access,
            scopes=record.scopes,
            rate_limit=record.rate_limit or "",
            expires=iso(record.expires_at) if record.expires_at else "",
            policies={
                name: _form_text(KEY_FIELDS[name], getattr(record, name)) for name in POLICY_FIELDS
            },
        )

    @property
    def has_policies(self) -> bool:
        """Whether any policy field is filled in (the form then shows them unfolded)."""
        return any(self.policies.values())


UNCHANGED: Final = object()
"""`read_key_form`'s expiry when the edit form kept the key's expiry as shown."""


def read_key_form(
    form: Form, offered: Collection[str], *, current: KeyRecord | None = None
) -> tuple[KeyForm, dict[str, str], datetime | object | None]:
    """The values, the errors by field, and the expiry the form asks for.

    With `current` (the edit form), an expiry left as it was shown is `UNCHANGED` (so a
    key that has already expired can be renamed), and the key's own scopes count as
    offered even when the page no longer offers them.
    """
    values = KeyForm(
        name=form.get("name", "").strip(),
        access=form.get("access", ""),
        scopes=tuple(dict.fromkeys(form.getlist("scopes"))),
        rate_limit=form.get("rate_limit", "").strip(),
        expires=form.get("expires", "").strip(),
        policies={name: form.get(name, "").strip() for name in POLICY_FIELDS},
    )
    errors: dict[str, str] = {}
    if not values.name:
        errors["name"] = "Give the key a label, such as the name of the integration."
    elif len(values.name) > MAX_LABEL:
        errors["name"] = f"The label must be at most {MAX_LABEL} characters."
    elif _CONTROL.search(values.name):
        errors["name"] = "The label must not contain control characters."
    allowed = set(offered) | set(current.scopes if current else ())
    if values.access not in ("full", "restricted"):
        errors["access"] = "Choose full access or restricted access."
    elif values.access == "restricted":
        unknown = [scope for scope in values.scopes if scope not in allowed]
        if unknown:
            errors["scopes"] = f"Unknown scope: {unknown[0][:50]}."
        elif not values.scopes:
            errors["scopes"] = "Pick at least one scope, or choose full access."
    if values.rate_limit:
        try:
            parse_policies(values.rate_limit)
        except InvalidKeyParameters:
            errors["rate_limit"] = (
                "Write the rate limit as a number per period, like 100/minute, 10/second "
                "or 3 per 2 seconds; several limits are named: burst=10/second, "
                "daily=10000/day."
            )
    expires_at: datetime | object | None = None
    if current is not None and values.expires == KeyForm.of(current).expires:
        expires_at = UNCHANGED
    else:
        try:
            expires_at = parse_expiry(values.expires, utcnow())
        except ValueError as exc:
            errors["expires"] = str(exc)
    return values, errors, expires_at


def read_policies(form: Form, values: KeyForm, errors: dict[str, str]) -> dict[str, Any]:
    """The `KeyManager.create`/`update` policy arguments of the fields the form sent
    (empty: None, cleared), adding an error per field that cannot be read. A field the
    form did not send is left out: unchanged by an edit, the default of a new key."""
    policy: dict[str, Any] = {name: None for name in POLICY_FIELDS if name in form}
    for name in policy:
        text = values.policies.get(name, "")
        if not text:
            continue
        try:
            policy[name] = _parse_text(KEY_FIELDS[name], text)
        except InvalidKeyParameters as exc:
            errors[name] = _sentence(str(exc))
    return policy


def _parse_text(field: KeyField, text: str) -> Any:
    """A policy field's form text through its parser (`POLICY_PARSERS`)."""
    parse = POLICY_PARSERS[field.name]
    if field.kind is Kind.NAMES:
        return parse(_RANGES.split(text))
    if field.kind is Kind.COUNT:
        # int() of 4,301 digits raises: a count is refused before it is that long.
        if not text.isascii() or not text.isdigit() or len(text) > 20:
            words = field.name.replace("_", " ")
            raise InvalidKeyParameters(f"{words} must be a whole number, like 1000")
        return parse(int(text))
    return parse(text)


_RANGES = re.compile(r"[\s,]+")


def requested_changes(
    form: Form,
    values: KeyForm,
    errors: Mapping[str, str],
    expires_at: datetime | object | None,
    policy: Mapping[str, Any],
) -> dict[str, object]:
    """What the create or edit form asks to set, as `apikeys.fields.check_change` reads it:
    only the fields it sent (an expiry kept as shown, or one that cannot be read, is not
    asked for), and any field of the form named `identity…` (no page form has one)."""
    requested: dict[str, object] = {"name": values.name, "access": values.access}
    if values.access == "restricted":
        requested["scopes"] = values.scopes
    if "rate_limit" in form:
        requested["rate_limit"] = values.rate_limit or None
    if expires_at is not UNCHANGED and "expires" not in errors:
        requested["expires_at"] = expires_at
    requested.update(policy)
    # A key's identity, and anything of an identity, is never the page's to set: a form
    # that sends one is refused (`check_change`), however it came to send it.
    requested.update({name: form[name] for name in form if name.startswith("identity")})
    return requested


def _sentence(message: str) -> str:
    return message[:1].upper() + message[1:] + ("" if message.endswith(".") else ".")
