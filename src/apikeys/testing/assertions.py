"""`assert_problem`: check a response against the contract's error model (RFC 9457).

It needs nothing beyond the standard library: it reads any response object with
`status_code`, `headers` and `content` (httpx, Starlette's `TestClient`, requests).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = [
    "CONTRACT_STATUS",
    "PROBLEM_CONTENT_TYPE",
    "AssertProblem",
    "ResponseLike",
    "assert_problem",
    "mask",
]

PROBLEM_CONTENT_TYPE = "application/problem+json"

CONTRACT_STATUS: Mapping[str, int] = {
    "missing_api_key": 401,
    "malformed_api_key": 401,
    "invalid_api_key": 401,
    "key_disabled": 401,
    "key_revoked": 401,
    "key_expired": 401,
    "insufficient_scope": 403,
    "ip_not_allowed": 403,
    "rate_limited": 429,
    "credits_exhausted": 429,
    "auth_unavailable": 503,
}
"""The HTTP status of every error code of the contract (CONTRACT section 4)."""

_TOKEN_CODES = frozenset(code for code, status in CONTRACT_STATUS.items() if status == 401) - {
    "missing_api_key"
}
_LONG_RUN = re.compile(r"[0-9A-Za-z]{8,}")
_SECONDS = re.compile(r"[0-9]{1,10}")
_PREVIEW = 300


class ResponseLike(Protocol):
    """What `assert_problem` reads: httpx and requests responses both fit."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content(self) -> bytes: ...


class AssertProblem(Protocol):
    """The type of `assert_problem` (and of the fixture of that name)."""

    def __call__(
        self, response: ResponseLike, code: str, status: int | None = None
    ) -> dict[str, Any]: ...


def mask(text: str) -> str:
    """`text` with every run of 8 or more base62 characters cut to its first 4 and `…`.

    Keys, secrets and anything derived from them never appear whole in a failure message.
    """
    return _LONG_RUN.sub(lambda match: match.group()[:4] + "…", text)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None:
        return value
    for key, item in headers.items():  # a plain dict: look the name up case-insensitively
        if key.lower() == name:
            return item
    return None


def _preview(content: bytes) -> str:
    text = content[:_PREVIEW].decode("utf-8", "replace")
    return mask(text) + ("…" if len(content) > _PREVIEW else "")


def _check_challenge(code: str, challenge: str | None, problems: list[str]) -> None:
    if challenge is None:
        problems.append("no WWW-Authenticate header")
        return
    if not challenge.lower().startswith("bearer ") or "realm=" not in challenge:
        problems.append(f"WWW-Authenticate is {challenge!r}, not a Bearer challenge with a realm")
    if code == "missing_api_key" and "error=" in challenge:
        problems.append("WWW-Authenticate names an error although no token was sent")
    if code in _TOKEN_CODES and 'error="invalid_token"' not in challenge:
        problems.append('WWW-Authenticate lacks error="invalid_token"')
    if code == "insufficient_scope" and (
        'error="insufficient_scope"' not in challenge or "scope=" not in challenge
    ):
        problems.append('WWW-Authenticate lacks error="insufficient_scope" and scope="…"')


def _check_body(
    body: Any, code: str, status_code: int, problems: list[str]
) -> dict[str, Any] | None:
    if not isinstance(body, dict):
        problems.append("the body is not a JSON object")
        return None
    for field in ("type", "title", "detail"):
        if not isinstance(body.get(field), str) or not body[field]:
            problems.append(f"body field {field!r} is missing or not a non-empty string")
    status = body.get("status")
    if not isinstance(status, int) or isinstance(status, bool) or status != status_code:
        problems.append(f"body status is {status!r}, the response status is {status_code}")
    if body.get("code") != code:
        problems.append(f"body code is {body.get('code')!r}, expected {code!r}")
    if code == "insufficient_scope":
        required = body.get("required_scopes")
        if (
            not isinstance(required, list)
            or not required
            or not all(isinstance(scope, str) for scope in required)
        ):
            problems.append("body field 'required_scopes' is not a non-empty list of scopes")
    return body


def _expected_status(code: str, status: int | None) -> int:
    __tracebackhide__ = True
    expected = CONTRACT_STATUS.get(code)
    if expected is None and status is None:
        raise ValueError(f"{code!r} is not a code of the contract: pass its status as well")
    if expected is not None and status is not None and status != expected:
        raise ValueError(f"the contract answers {code!r} with {expected}, not {status}")
    result = status if status is not None else expected
    assert result is not None
    return result


def _check_content(
    content: bytes, code: str, status_code: int, problems: list[str]
) -> dict[str, Any] | None:
    body: dict[str, Any] | None = None
    try:
        parsed = json.loads(content)
    except ValueError:
        problems.append("the body is not JSON")
    else:
        body = _check_body(parsed, code, status_code, problems)
    if b"Traceback (most recent call last)" in content:
        problems.append("the body shows a stack trace")
    return body


def _check_content_type(headers: Mapping[str, str], problems: list[str]) -> None:
    content_type = _header(headers, "content-type") or ""
    if content_type.split(";", 1)[0].strip().lower() != PROBLEM_CONTENT_TYPE:
        problems.append(f"Content-Type is {content_type!r}, expected {PROBLEM_CONTENT_TYPE!r}")


def _check_challenge_and_wait(
    headers: Mapping[str, str], code: str, status_code: int, problems: list[str]
) -> None:
    if status_code == 401 or code == "insufficient_scope":
        _check_challenge(code, _header(headers, "www-authenticate"), problems)
    # `credits_exhausted` without a refill has no time to wait for: no Retry-After.
    retry_after = _header(headers, "retry-after")
    waits = status_code in (429, 503) and (code != "credits_exhausted" or retry_after is not None)
    if waits and (
        retry_after is None or not _SECONDS.fullmatch(retry_after) or int(retry_after) < 1
    ):
        problems.append(f"Retry-After is {retry_after!r}, expected whole seconds, at least 1")


def assert_problem(response: ResponseLike, code: str, status: int | None = None) -> dict[str, Any]:
    """Assert that `response` is the contract's problem response for `code`; return its body.

    Checks the status (the contract's for `code`; pass `status` for codes of your own),
    `Content-Type: application/problem+json`, the body's `type`, `title`, `status`,
    `detail` and `code` (and `required_scopes` for `insufficient_scope`), the RFC 6750
    `WWW-Authenticate` challenge of a 401 or an `insufficient_scope` 403, a `Retry-After`
    of whole seconds on a 429 or 503 (optional for `credits_exhausted`: a key whose credits
    are never refilled has no time to wait for), and that no stack trace is shown. Every
    failed check is listed in one `AssertionError`, with the body (long base62 runs masked).

    ```python
    response = client.get("/api/v1/contacts", headers={"Authorization": "Bearer nope"})
    body = assert_problem(response, "malformed_api_key")
    ```
    """
    __tracebackhide__ = True
    expected = _expected_status(code, status)
    problems: list[str] = []
    status_code = response.status_code
    if status_code != expected:
        problems.append(f"status is {status_code}, expected {expected}")
    _check_content_type(response.headers, problems)
    content = response.content
    body = _check_content(content, code, status_code, problems)
    _check_challenge_and_wait(response.headers, code, status_code, problems)
    if problems:
        raise AssertionError(
            f"not a {code!r} problem response:\n  - "
            + "\n  - ".join(problems)
            + f"\n  body: {_preview(content)}"
        )
    assert body is not None
    return body
