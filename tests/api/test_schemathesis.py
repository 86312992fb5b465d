"""schemathesis against the management API on SQLite and PostgreSQL: from the OpenAPI
document it serves, cases that follow the schemas and cases that break them, each answer
held to schemathesis' default checks (no 500, the answer conforms to the document, its
status is documented, data that breaks the schema is refused). The caller is an operator,
so the webhook operations are called too. Finds nothing.

The calls run in one event loop of the test's own (`asyncio.Runner`) through httpx's ASGI
transport, so the store's connections stay on the loop they were made on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from requests.adapters import BaseAdapter
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.api import ManagementAPI
from tests.conftest import TEST_PEPPER

# Small enough that both stores take well under 30 s together.
EXAMPLES = 6
# A body the schemas accept may still be refused for what it means (a scope that is not in
# the scope grammar, a rate limit that does not parse, a restricted key without scopes):
# 400 with the reason. And an Idempotency-Key the generator happens to send twice with two
# bodies is refused, 422, as the IETF draft has it; an If-Match of a version the key is not
# at, 412. Every other default stays as it is.
CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "400", "401", "403", "404", "409", "412", "422", "429"]
            }
        }
    }
)
STORES = [
    pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
]


def raw_headers(headers: Any) -> list[tuple[bytes, bytes]]:
    """Headers as the bytes a client puts on the wire (httpx takes only ASCII text)."""

    def raw(text: str | bytes) -> bytes:
        if isinstance(text, bytes):
            return text
        try:
            return text.encode("latin-1")
        except UnicodeEncodeError:
            return text.encode("utf-8")

    return [(raw(name), raw(value)) for name, value in dict(headers or {}).items()]


class InLoop(BaseAdapter):
    """A `requests` adapter that sends to the service's httpx client, in the service's loop:
    for the requests schemathesis' checks send themselves (`ignored_auth` sends the call
    again without its key)."""

    def __init__(self, service: Service) -> None:
        super().__init__()
        self.service = service

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        sent = self.service.runner.run(
            self.service.client.request(
                str(request.method),
                str(request.url),
                headers=raw_headers(request.headers),
                content=request.body if isinstance(request.body, bytes) else None,
            )
        )
        answer = requests.Response()
        answer.status_code = sent.status_code
        answer.headers.update(sent.headers)
        answer._content = sent.content
        answer.url = str(request.url)
        answer.request = request
        answer.reason = sent.reason_phrase
        return answer

    def close(self) -> None:
        pass


class Service:
    """The API on one store, called from a loop of the test's own. `serve` says what app
    answers (the API alone here) and the document of its operations."""

    prefix = ""
    """Where the API's paths start in the app served."""

    def __init__(self, runner: asyncio.Runner, url: str, options: dict[str, str]) -> None:
        self.runner = runner
        # The manager sends no webhooks: the endpoints the cases add have made-up URLs.
        self.manager = KeyManager(
            store_from_url(url, **options), hasher=Hasher(pepper=TEST_PEPPER), webhooks=False
        )
        self.app, self.document = self.serve(rate_limit="1000000/minute", operators=["acme"])
        transport = httpx.ASGITransport(app=self.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://test")
        runner.run(self.manager.setup())
        created = runner.run(self.manager.create(name="caller", workspace="acme", full_access=True))
        self.auth = {"Authorization": f"Bearer {created.key}"}
        # The webhook operations are called by an operator: a key of `acme` that names
        # `apikeys:admin`, so that the cases reach them.
        operator = runner.run(
            self.manager.create(
                name="operator", workspace="acme", scopes=["apikeys:read", "apikeys:admin"]
            )
        )
        self.operator = {"Authorization": f"Bearer {operator.key}"}

    def serve(self, **options: Any) -> tuple[Any, dict[str, Any]]:
        """The app to call, and the OpenAPI document of the operations to call."""
        api = ManagementAPI(self.manager, **options)
        return api, api.document

    def auth_for(self, case: Any) -> dict[str, str]:
        """The caller's headers for `case`: the operator's for a webhook operation."""
        webhooks = case.operation.path.startswith(f"{self.prefix}/webhooks")
        return self.operator if webhooks else self.auth

    def call(self, case: Any) -> httpx.Response:
        kwargs = case.as_transport_kwargs(base_url="http://test", headers=self.auth_for(case))
        request: dict[str, Any] = {
            "method": kwargs["method"],
            "url": kwargs["url"],
            "headers": raw_headers(kwargs.get("headers")),
            "params": kwargs.get("params"),
        }
        if "json" in kwargs:
            request["json"] = kwargs["json"]
        elif kwargs.get("data") is not None:
            request["content"] = kwargs["data"]
        return self.runner.run(self.client.request(**request))

    def close(self) -> None:
        self.runner.run(self.client.aclose())
        self.runner.run(self.manager.aclose())


def serving(
    kind: type[Service], url: str, options: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Service]:
    """A `kind` of service on the store at `url`, which the calls schemathesis makes on its
    own reach too."""
    with asyncio.Runner() as runner:
        running = kind(runner, url, options)
        from schemathesis.transport import requests as sent_by_schemathesis

        class ToService(sent_by_schemathesis.SameHostRedirectsSession):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.mount("http://test", InLoop(running))

        # The calls schemathesis makes on its own (`ignored_auth` calls again without the
        # key) reach the service in its loop, not the network.
        monkeypatch.setattr(sent_by_schemathesis, "SameHostRedirectsSession", ToService)
        try:
            yield running
        finally:
            running.close()


@pytest.fixture
def service(
    store_url: str, store_options: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Service]:
    yield from serving(Service, store_url, store_options, monkeypatch)


def finds_nothing(service: Service) -> None:
    """schemathesis' default checks on every operation of `service.document` under its
    prefix, positive and negative cases, find nothing."""
    schema = schemathesis.openapi.from_dict(service.document, config=CONFIG)
    strategies = [
        result.ok().as_strategy(generation_mode=mode)
        for result in schema.get_all_operations()
        if result.ok().path.startswith(f"{service.prefix}/")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ]
    assert strategies

    @given(case=st.one_of(strategies))
    @settings(
        max_examples=EXAMPLES * len(strategies),
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    def check(case: Any) -> None:
        response = service.call(case)
        case.validate_response(
            response,
            headers=service.auth_for(case),
            transport_kwargs={"base_url": "http://test"},
        )

    check()


@pytest.mark.parametrize("store_kind", STORES)
def test_schemathesis_finds_nothing(service: Service) -> None:
    finds_nothing(service)
