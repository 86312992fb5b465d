"""`assert_rejects_bad_credentials`: a property-based check of an app's authentication.

```python
from apikeys.testing import assert_rejects_bad_credentials

def test_api_refuses_bad_credentials(app, make_key):
    created = make_key.sync(scopes=["contacts:read"])
    assert_rejects_bad_credentials(app, "/api/v1/contacts", valid_key=created.key)
```

The app is driven directly over ASGI, with no server and no HTTP client in between, so
header bytes no client library would send (NUL, CR LF, latin-1, 100 KB values) reach it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from apikeys.errors import APIKeyError
from apikeys.keys import DEFAULT_PREFIX, parse_key
from apikeys.testing.assertions import mask
from apikeys.testing.strategies import labelled_authorization_headers
from apikeys.types import ASGIApp, Message

__all__ = [
    "BadCredentials",
    "assert_rejects_bad_credentials",
    "async_assert_rejects_bad_credentials",
]

Header = tuple[bytes, bytes]

_SHOWN_BYTES = 96
_CREDENTIAL_RUN = re.compile(rb"[0-9A-Za-z]{20,}")
_NOTE_RUN = re.compile(r"[0-9A-Za-z]{16,}")
_QUERY_NAMES = (b"api_key", b"access_token", b"apikey", b"key", b"token")


def _cut(match: re.Match[str]) -> str:
    return match.group()[:4] + "…"


def _show(value: bytes) -> str:
    shown = mask(repr(value[:_SHOWN_BYTES]))
    if len(value) > _SHOWN_BYTES:
        shown += f"… ({len(value)} bytes)"
    return shown


@dataclass(frozen=True)
class BadCredentials:
    """One request's worth of credentials that must not authenticate.

    `authorization` holds the `Authorization` header values sent (none, one or two);
    `other_headers` and `query_string` carry a key where no key may be read. Its repr
    masks every long base62 run, so failure reports never show a key whole.
    """

    label: str
    authorization: tuple[bytes, ...] = ()
    other_headers: tuple[Header, ...] = ()
    query_string: bytes = b""

    def headers(self) -> list[Header]:
        """The request's raw ASGI headers."""
        return [
            (b"host", b"testserver"),
            *((b"authorization", value) for value in self.authorization),
            *self.other_headers,
        ]

    def describe(self) -> str:
        """What was sent, secrets masked."""
        parts = [self.label]
        if not self.authorization:
            parts.append("no Authorization header")
        parts += [f"Authorization: {_show(value)}" for value in self.authorization]
        parts += [f"{name.decode('latin-1')}: {_show(value)}" for name, value in self.other_headers]
        if self.query_string:
            parts.append(f"query string: {_show(self.query_string)}")
        return "; ".join(parts)

    def __repr__(self) -> str:
        return f"BadCredentials({self.describe()})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Hypothesis prints dataclasses field by field, unmasked, unless told otherwise.
        printer.text(repr(self))

    def material(self) -> set[bytes]:
        """Long base62 runs of what was sent: none may come back in the response."""
        sent = [*self.authorization, *(value for _, value in self.other_headers)]
        sent.append(self.query_string)
        return {run for value in sent for run in _CREDENTIAL_RUN.findall(value)}


def _bad_credentials(valid_key: str | None, prefix: str) -> st.SearchStrategy[BadCredentials]:
    headers = labelled_authorization_headers(valid_key, prefix=prefix).map(
        lambda pair: BadCredentials(pair[0], (pair[1],))
    )
    options = [st.just(BadCredentials("no credentials")), headers, headers, headers]
    if valid_key is not None:
        key = valid_key.encode("ascii")
        options += [
            st.sampled_from(
                (
                    (b"x-api-key", key),
                    (b"api-key", key),
                    (b"apikey", key),
                    (b"cookie", b"api_key=" + key),
                    (b"cookie", b"access_token=" + key),
                    (b"proxy-authorization", b"Bearer " + key),
                    (b"x-authorization", b"Bearer " + key),
                )
            ).map(lambda header: BadCredentials("key outside Authorization", (), (header,))),
            st.sampled_from(_QUERY_NAMES).map(
                lambda name: BadCredentials(
                    "key in the query string", query_string=name + b"=" + key
                )
            ),
            st.tuples(headers, st.booleans()).map(
                lambda pair: BadCredentials(
                    "two Authorization headers, one of them valid",
                    (b"Bearer " + key, *pair[0].authorization)
                    if pair[1]
                    else (*pair[0].authorization, b"Bearer " + key),
                )
            ),
        ]
    return st.one_of(options)


def _classic_credentials(valid_key: str | None) -> list[BadCredentials]:
    """The mistakes every check tries first, whatever hypothesis then draws."""
    classic = [
        BadCredentials("no credentials"),
        BadCredentials("empty value", (b"",)),
        BadCredentials("scheme only", (b"Bearer",)),
        BadCredentials("latin-1 byte", (b"Bearer \xe9",)),
        BadCredentials("control byte", (b"Bearer \x00",)),
        BadCredentials("huge value", (b"Bearer " + b"A" * 100_000,)),
    ]
    if valid_key is not None:
        key = valid_key.encode("ascii")
        classic += [
            BadCredentials("latin-1 byte", (b"Bearer " + key + b"\xff",)),
            BadCredentials("key in the query string", query_string=b"api_key=" + key),
            BadCredentials(
                "two Authorization headers, one of them valid", (b"Bearer " + key, b"Basic x")
            ),
        ]
    return classic


@dataclass
class _Exchange:
    """What the app sent back."""

    status: int | None = None
    headers: list[Header] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def code(self) -> object:
        try:
            body = json.loads(bytes(self.body))
        except ValueError:
            return None
        return body.get("code") if isinstance(body, dict) else None


class _Check:
    """One app, one path: sends bad credentials and judges the answers."""

    def __init__(
        self,
        app: ASGIApp,
        path: str,
        method: str,
        valid_key: str | None,
        prefix: str | None,
        timeout: float,
    ) -> None:
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', not {path!r}")
        if valid_key is not None:
            try:
                prefix = parse_key(valid_key).prefix
            except APIKeyError:
                raise ValueError("valid_key is not a well-formed key") from None
        self.app = app
        self.method = method.upper()
        self.path, _, query = path.partition("?")
        self.query = query.encode("latin-1")
        self.valid_key = valid_key
        self.prefix = prefix or DEFAULT_PREFIX
        self.timeout = timeout

    def strategy(self) -> st.SearchStrategy[BadCredentials]:
        return _bad_credentials(self.valid_key, self.prefix)

    def classic(self) -> list[BadCredentials]:
        return _classic_credentials(self.valid_key)

    def _scope(self, credentials: BadCredentials) -> dict[str, Any]:
        query = b"&".join(part for part in (self.query, credentials.query_string) if part)
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": unquote(self.path),
            "raw_path": self.path.encode("latin-1"),
            "query_string": query,
            "root_path": "",
            "headers": credentials.headers(),
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
            "state": {},
        }

    async def _exchange(self, credentials: BadCredentials, exchange: _Exchange) -> None:
        done = asyncio.Event()
        request_sent = False

        async def receive() -> Message:
            nonlocal request_sent
            if not request_sent:
                request_sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = int(message["status"])
                exchange.headers = list(message.get("headers", ()))
            elif message["type"] == "http.response.body":
                exchange.body += message.get("body", b"")
                if not message.get("more_body", False):
                    done.set()

        async with asyncio.timeout(self.timeout):
            await self.app(self._scope(credentials), receive, send)

    def _verdict(
        self, credentials: BadCredentials, exchange: _Exchange, error: BaseException | None
    ) -> str | None:
        status = exchange.status
        if isinstance(error, TimeoutError):
            return f"gave no answer within {self.timeout:g} seconds"
        if error is not None:
            answered = f" (after starting a {status} response)" if status is not None else ""
            return f"raised {type(error).__name__}{answered}"
        if status is None:
            return "sent no response"
        if status < 400:
            return f"let the request through: {status}"
        if status >= 500 and not (status == 503 and exchange.code() == "auth_unavailable"):
            return f"answered {status} (only 503 auth_unavailable may fail closed)"
        answer = bytes(exchange.body) + b"\n".join(value for _, value in exchange.headers)
        if any(run in answer for run in credentials.material()):
            return f"echoed the credentials it was sent in its {status} response"
        return None

    async def one(self, credentials: BadCredentials) -> None:
        """Send `credentials` once; raise `AssertionError` unless they are refused."""
        __tracebackhide__ = True
        exchange = _Exchange()
        error: BaseException | None = None
        try:
            await self._exchange(credentials, exchange)
        except Exception as exc:
            error = exc
        problem = self._verdict(credentials, exchange, error)
        if problem is None:
            return
        content_type = (exchange.header(b"content-type") or b"").decode("latin-1")
        message = (
            f"{self.method} {self.path} {problem}, for bad credentials: "
            f"{credentials.describe()}\n"
            f"  response: {exchange.status} {content_type} {_show(bytes(exchange.body))}"
        )
        raise AssertionError(message) from error


def _search(
    run: Callable[[BadCredentials], None],
    strategy: st.SearchStrategy[BadCredentials],
    max_examples: int,
    classic: list[BadCredentials],
) -> None:
    __tracebackhide__ = True

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        print_blob=False,
        # Shrinking finds the simplest offending request; the explain phase would only
        # trace which lines of the check ran, at a high price in time.
        phases=[phase for phase in Phase if phase is not Phase.explain],
    )
    @given(credentials=strategy)
    def bad_credentials_are_refused(credentials: BadCredentials) -> None:
        run(credentials)

    # Tried before anything is drawn: a check that misses a classic mistake by chance of
    # the draw would pass one run and fail the next.
    for credentials in reversed(classic):
        bad_credentials_are_refused = example(credentials=credentials)(bad_credentials_are_refused)
    try:
        bad_credentials_are_refused()
    except BaseException as exc:
        # Hypothesis notes the failing example; mask whatever key material it shows.
        notes = getattr(exc, "__notes__", None)
        if isinstance(notes, list):
            notes[:] = [_NOTE_RUN.sub(_cut, note) for note in notes]
        raise


def assert_rejects_bad_credentials(
    app: ASGIApp,
    path: str,
    *,
    method: str = "GET",
    max_examples: int = 200,
    valid_key: str | None = None,
    prefix: str | None = None,
    request_timeout: float = 10.0,
) -> None:
    """Assert that `app` refuses every kind of bad credentials on `method path`.

    Sends a few classic mistakes first, every time (no header, an empty value, `Bearer`
    alone, a latin-1 byte, NUL, a 100 KB value and, with `valid_key`, that key in the query
    string or beside a second `Authorization` header), then up to `max_examples` requests
    generated by hypothesis, straight to the ASGI `app`: no `Authorization` header;
    hostile values (NUL, CR LF, latin-1 and control bytes, huge values, other schemes,
    `Bearer` repeated or without its space, tabs); damaged, unknown and (with `valid_key`)
    wrong-secret keys. With `valid_key`, a real key the path accepts, it also sends that
    key where no key may be read (query string, `X-API-Key`, cookies, a second
    `Authorization` header beside a bad one) and builds every variant around it. `prefix`
    is the key prefix of unknown keys when `valid_key` is not given (default `ak`).

    Raises `AssertionError`, naming the offending request with every key masked, when a
    request gets a 1xx, 2xx or 3xx answer, a 5xx (a 503 `auth_unavailable` is allowed:
    that is failing closed), no answer (within `request_timeout` seconds), an exception, or a
    response that echoes a long run of what was sent. Hypothesis shrinks a failure to a
    simple example first.

    Call it from synchronous tests; it runs an event loop of its own. In an async test,
    `await async_assert_rejects_bad_credentials(...)` instead.
    """
    __tracebackhide__ = True
    check = _Check(app, path, method, valid_key, prefix, request_timeout)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "assert_rejects_bad_credentials() runs its own event loop, and one is running "
            "here: in an async test, use `await async_assert_rejects_bad_credentials(...)`"
        )
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:

        def run(credentials: BadCredentials) -> None:
            runner.run(check.one(credentials))

        _search(run, check.strategy(), max_examples, check.classic())


async def async_assert_rejects_bad_credentials(
    app: ASGIApp,
    path: str,
    *,
    method: str = "GET",
    max_examples: int = 200,
    valid_key: str | None = None,
    prefix: str | None = None,
    request_timeout: float = 10.0,
) -> None:
    """`assert_rejects_bad_credentials` for async tests: the app runs on the test's loop.

    Hypothesis runs in a worker thread; each request is sent on the caller's event loop,
    so an app (or key store) bound to that loop works as it does in the test.
    """
    __tracebackhide__ = True
    check = _Check(app, path, method, valid_key, prefix, request_timeout)
    loop = asyncio.get_running_loop()

    def run(credentials: BadCredentials) -> None:
        coroutine: Coroutine[Any, Any, None] = check.one(credentials)
        asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    await asyncio.to_thread(_search, run, check.strategy(), max_examples, check.classic())
