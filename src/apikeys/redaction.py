"""Naming a key store and its failure to an operator without showing its password, and
keeping the values of the store's statements out of its drivers' logs.

The command line and `KeyManager` say a store they cannot reach the same way:
`key store unavailable: postgresql://app:***@db.internal/keys: ConnectionRefusedError: …`.
"""

from __future__ import annotations

import functools
import logging
from typing import Final
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = ["failure_reason", "hide_values_in_driver_logs", "redact", "safe_url"]


def safe_url(url: str) -> str:
    """`url` with its password, if any, replaced by `***`."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<the key store URL>"
    if not password:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def redact(text: str, url: str) -> str:
    """`text` with any password of `url` replaced by `***`."""
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    if password:
        for form in {password, unquote(password)}:
            text = text.replace(form, "***")
    return text


def failure_reason(error: BaseException) -> str:
    """`Type: first line of the message`, or `Type` alone when the message is empty."""
    detail = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    name = type(error).__name__
    return f"{name}: {detail}" if detail else name


# Loggers of the SQL store's dependencies that print a statement's values at DEBUG: aiosqlite
# logs every call it runs with its arguments (a statement's parameters hold a key's hash),
# SQLAlchemy every row a statement returns (`hide_parameters` hides the parameters, not the
# rows). Each record is kept, with the values replaced.
_AIOSQLITE: Final = "aiosqlite"
_SQLALCHEMY_ENGINE: Final = "sqlalchemy.engine.Engine"


def _shape(value: object) -> object:
    """What a driver's log argument is, without the values it carries."""
    if isinstance(value, functools.partial):
        name = getattr(value.func, "__qualname__", type(value.func).__name__)
        args = value.args
        # The statement's text is kept (it holds no value: they are bound parameters).
        shown = [repr(args[0])] if args and isinstance(args[0], str) else []
        if len(args) > len(shown) or value.keywords:
            shown.append("<arguments hidden>")
        return f"{name}({', '.join(shown)})"
    if isinstance(value, BaseException):
        return type(value).__name__
    return f"<{type(value).__name__}>"


class _HideValues(logging.Filter):
    """Keeps a driver's records, with every value a statement carried replaced."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == _SQLALCHEMY_ENGINE:
            if isinstance(record.msg, str) and record.msg.startswith("Row "):
                record.msg, record.args = "Row [values hidden]", ()
            return True
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_shape(arg) for arg in args)
        elif args:
            record.msg, record.args = f"{record.msg} [arguments hidden]", ()
        return True


_FILTER: Final = _HideValues()


def hide_values_in_driver_logs() -> None:
    """Install the filter that keeps hashes out of aiosqlite's and SQLAlchemy's DEBUG logs.

    Idempotent; called wherever apikeys makes an engine. A filter applies to the records of
    its own logger only, and both libraries log to exactly these names (an engine made
    without a `logging_name`, as apikeys makes them).
    """
    for name in (_AIOSQLITE, _SQLALCHEMY_ENGINE):
        logging.getLogger(name).addFilter(_FILTER)
