"""Naming a key store and its failure to an operator without showing its password.

The command line and `KeyManager` say a store they cannot reach the same way:
`key store unavailable: postgresql://app:***@db.internal/keys: ConnectionRefusedError: …`.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = ["failure_reason", "redact", "safe_url"]


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
