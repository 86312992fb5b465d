"""GitHub's secret scanning alerts at `POST /api/v1/secret-scanning`, over HTTP.

The service runs as a user runs it, with `EXAMPLE_GITHUB_KEYS_URL` pointing at a key-list
server of the test's own (a thread serving `{"public_keys": [...]}`); the test signs the
alerts with a P-256 key pair it makes, as GitHub signs them with its own. What the endpoint
did is checked the way a client would notice it: by using the reported key against the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from examples.contacts_service.settings import Settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apikeys import Hasher, KeyManager, generate_key, parse_key, store_from_url
from apikeys.keys import ParsedKey
from apikeys.leaks.github import (
    MAX_ALERTS,
    MAX_BODY_BYTES,
)
from tests.examples.conftest import PEPPER, free_port, service_env, start_service, stop_service
from tests.leaks.github_side import TOKEN_TYPE, KeyListServer, Signer, alerts

PATH = "/api/v1/secret-scanning"
PROBLEM = "application/problem+json"


# -- GitHub's side: a key pair, its key list, signed alerts ------------------------------------


def verdicts(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [
        {"token_raw": token, "token_type": TOKEN_TYPE, "label": label} for token, label in pairs
    ]


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert (body["status"], body["code"]) == (status, code)
    return body


# -- the service --------------------------------------------------------------------------------


@dataclass
class Service:
    base_url: str
    store_url: str
    signer: Signer
    log: Path

    def _manager(self) -> KeyManager:
        return KeyManager(store_from_url(self.store_url), hasher=Hasher(pepper=PEPPER))

    def create_key(self, *, state: str = "active") -> str:
        async def create() -> str:
            async with self._manager() as manager:
                created = await manager.create(
                    name="leaky", workspace=f"ws-{uuid.uuid4().hex[:8]}", full_access=True
                )
                if state == "revoked":
                    await manager.revoke(created.record.id)
                elif state == "disabled":
                    await manager.disable(created.record.id)
            return created.key

        return asyncio.run(create())

    def status_of(self, key: str) -> str:
        async def status() -> str:
            async with self._manager() as manager:
                return (await manager.get(parse_key(key).id)).status

        return asyncio.run(status())

    def audit_of(self, key: str) -> list[tuple[str, str | None]]:
        """The key's audit trail, as (action, actor) pairs."""

        async def events() -> list[tuple[str, str | None]]:
            async with self._manager() as manager:
                found = await manager.audit(key_id=parse_key(key).id)
            return [(event.action, event.actor) for event in found]

        return asyncio.run(events())

    def use(self, key: str) -> httpx.Response:
        """A request with `key`, as the integration holding it would make."""
        return httpx.get(
            f"{self.base_url}/api/v1/contacts",
            headers={"Authorization": f"Bearer {key}"},
            timeout=10,
        )

    def post(
        self,
        body: bytes,
        headers: dict[str, str] | None = None,
        *,
        content_type: str = "application/json",
    ) -> httpx.Response:
        if headers is None:
            headers = self.signer.headers(body)
        return httpx.post(
            f"{self.base_url}{PATH}",
            content=body,
            headers={"Content-Type": content_type, **headers},
            timeout=30,
        )


@contextlib.contextmanager
def running_service(
    tmp: Path, signer: Signer, key_list: KeyListServer | None, **env: str
) -> Iterator[Service]:
    """The service with its own stores; GitHub's keys at `key_list` (or at a closed port)."""
    store_url = f"sqlite:///{tmp / 'apikeys.db'}"
    keys_url = key_list.url if key_list is not None else f"http://127.0.0.1:{free_port()}/keys"
    environment = service_env(
        APIKEYS_STORE_URL=store_url,
        EXAMPLE_DATABASE_URL=f"sqlite:///{tmp / 'example.db'}",
        EXAMPLE_GITHUB_KEYS_URL=keys_url,
        **env,
    )
    log = tmp / "service.log"
    process, base_url = start_service(environment, log)
    try:
        yield Service(base_url, store_url, signer, log)
    finally:
        stop_service(process, log)


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, signer: Signer) -> Iterator[Service]:
    # An older key of GitHub's is listed too, as the real list does.
    with (
        KeyListServer([Signer().entry(current=False), signer.entry()]) as key_list,
        running_service(tmp_path_factory.mktemp("leaks"), signer, key_list) as running,
    ):
        yield running


def unknown_token() -> str:
    """A token in the key format, checksum right, whose id no store holds."""
    return generate_key().token


# -- verdicts ---------------------------------------------------------------------------------


def test_if_a_real_key_is_reported_then_it_is_revoked_and_a_true_positive(
    service: Service,
) -> None:
    key = service.create_key()
    assert service.use(key).status_code == 200

    response = service.post(alerts(key))

    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == verdicts((key, "true_positive"))
    assert_problem(service.use(key), 401, "key_revoked")
    assert service.status_of(key) == "revoked"
    assert service.audit_of(key)[-1] == ("leak_revoked", "github-secret-scanning")


def test_if_the_id_is_unknown_then_a_false_positive(service: Service) -> None:
    token = unknown_token()
    response = service.post(alerts(token))
    assert response.status_code == 200, response.text
    assert response.json() == verdicts((token, "false_positive"))


@pytest.mark.parametrize(
    "token",
    [
        "ak_3xK9pQ2mZ7aB_Vd2hT8kLq4WnYc0uJ5sRb7xE1gMa9oPfQ1w2e3",  # the shape, a bad checksum
        "ak_short",
        "not a key at all",
        "acme_live_3xK9pQ2mZ7aB_Vd2hT8kLq4WnYc0uJ5sRb7xE1gMa9oPfQ1w2e3",
    ],
)
def test_if_not_a_key_of_ours_then_a_false_positive(service: Service, token: str) -> None:
    response = service.post(alerts(token))
    assert response.status_code == 200, response.text
    assert response.json() == verdicts((token, "false_positive"))


def test_if_another_prefix_with_a_valid_checksum_then_a_false_positive(
    service: Service,
) -> None:
    token = generate_key("acme_live").token
    assert service.post(alerts(token)).json() == verdicts((token, "false_positive"))


def test_if_a_real_id_comes_with_a_made_up_secret_then_nothing_is_revoked(
    service: Service,
) -> None:
    key = service.create_key()
    real = parse_key(key)
    planted = ParsedKey(real.prefix, real.id, generate_key().secret).token

    response = service.post(alerts(planted))

    assert response.json() == verdicts((planted, "false_positive"))
    assert service.use(key).status_code == 200
    assert service.status_of(key) == "active"


def test_if_the_key_is_already_revoked_then_a_true_positive_and_it_stays_revoked(
    service: Service,
) -> None:
    key = service.create_key(state="revoked")

    response = service.post(alerts(key))

    assert response.json() == verdicts((key, "true_positive"))
    assert_problem(service.use(key), 401, "key_revoked")
    assert service.status_of(key) == "revoked"


def test_if_the_key_is_disabled_then_a_true_positive_and_it_is_revoked(
    service: Service,
) -> None:
    key = service.create_key(state="disabled")

    assert service.post(alerts(key)).json() == verdicts((key, "true_positive"))
    assert_problem(service.use(key), 401, "key_revoked")


def test_if_a_batch_mixes_tokens_then_one_verdict_each_in_order(service: Service) -> None:
    first, second, unknown = service.create_key(), service.create_key(), unknown_token()
    noise = "ak_3xK9pQ2mZ7aB_Vd2hT8kLq4WnYc0uJ5sRb7xE1gMa9oPfQ1w2e3"

    response = service.post(alerts(first, unknown, noise, second, first))

    assert response.json() == verdicts(
        (first, "true_positive"),
        (unknown, "false_positive"),
        (noise, "false_positive"),
        (second, "true_positive"),
        (first, "true_positive"),
    )
    for key in (first, second):
        assert_problem(service.use(key), 401, "key_revoked")


def test_verdicts_are_logged_with_the_masked_key_never_the_token(service: Service) -> None:
    key, planted = service.create_key(), unknown_token()

    assert service.post(alerts(key, planted)).status_code == 200

    log = service.log.read_text()
    assert f"true_positive: {parse_key(key).masked} found in public" in log
    assert f"key.revoked key={parse_key(key).masked} actor=github-secret-scanning" in log
    assert key not in log
    assert planted not in log
    assert parse_key(key).secret not in log


def test_if_the_alert_lists_no_token_then_an_empty_answer(service: Service) -> None:
    response = service.post(b"[]")
    assert response.status_code == 200
    assert response.json() == []


def test_if_disable_is_the_leak_action_then_the_key_is_disabled(
    tmp_path: Path, signer: Signer
) -> None:
    with (
        KeyListServer([signer.entry()]) as key_list,
        running_service(tmp_path, signer, key_list, EXAMPLE_LEAK_ACTION="disable") as service,
    ):
        key = service.create_key()
        revoked = service.create_key(state="revoked")

        response = service.post(alerts(key, revoked))

        assert response.json() == verdicts((key, "true_positive"), (revoked, "true_positive"))
        assert_problem(service.use(key), 401, "key_disabled")
        assert service.status_of(key) == "disabled"
        assert service.status_of(revoked) == "revoked"  # never "downgraded" to disabled


# -- signatures --------------------------------------------------------------------------------


def test_if_unsigned_then_401_and_nothing_revoked(service: Service) -> None:
    key = service.create_key()
    body = alerts(key)
    signed = service.signer.headers(body)

    assert_problem(service.post(body, {}), 401, "missing_signature")
    for name in signed:  # one header of the two
        only = {name: signed[name]}
        assert_problem(service.post(body, only), 401, "missing_signature")
    assert service.use(key).status_code == 200


def test_if_the_signature_is_wrong_then_401_and_nothing_revoked(service: Service) -> None:
    key = service.create_key()
    body = alerts(key)
    identifier = service.signer.identifier
    wrong = [
        # signed, but another body
        service.signer.headers(alerts(unknown_token())),
        # this body, but signed by a key that is not the one the identifier names
        Signer().headers(body, identifier=identifier),
        # not base64, not DER, empty
        {"Github-Public-Key-Identifier": identifier, "Github-Public-Key-Signature": "%%%"},
        {"Github-Public-Key-Identifier": identifier, "Github-Public-Key-Signature": "AAAA"},
        {"Github-Public-Key-Identifier": identifier, "Github-Public-Key-Signature": ""},
        {"Github-Public-Key-Identifier": "", "Github-Public-Key-Signature": "AAAA"},
    ]
    for headers in wrong:
        response = service.post(body, headers)
        code = "missing_signature" if "" in headers.values() else "invalid_signature"
        assert_problem(response, 401, code)
    # The signature of the body with one byte more (the trailing newline of a re-serialised
    # body): the raw bytes are what is signed.
    assert_problem(
        service.post(body + b"\n", service.signer.headers(body)), 401, "invalid_signature"
    )
    assert service.use(key).status_code == 200


def test_if_the_key_identifier_is_unknown_then_401_after_one_refetch(
    tmp_path: Path, signer: Signer
) -> None:
    stranger = Signer()  # signs well, but GitHub does not list its key
    with (
        KeyListServer([signer.entry()]) as key_list,
        running_service(tmp_path, signer, key_list) as service,
    ):
        key = service.create_key()
        body = alerts(key)
        garbage = {"Github-Public-Key-Identifier": "x", "Github-Public-Key-Signature": "AAAA"}
        assert_problem(service.post(body, garbage), 401, "invalid_signature")
        assert key_list.fetches == 0  # not even a signature: no fetch for it

        problem = assert_problem(
            service.post(body, stranger.headers(body)), 401, "invalid_signature"
        )
        assert "identifier" in problem["detail"]
        assert key_list.fetches == 1
        # Within the minute, another unknown identifier does not fetch the list again.
        assert_problem(service.post(body, stranger.headers(body)), 401, "invalid_signature")
        assert key_list.fetches == 1
        assert service.use(key).status_code == 200

        # GitHub's own key still verifies, from the list in memory.
        assert service.post(body).json() == verdicts((key, "true_positive"))
        assert key_list.fetches == 1


def test_if_the_key_list_cannot_be_fetched_then_503_and_nothing_revoked(
    tmp_path: Path, signer: Signer
) -> None:
    with running_service(tmp_path, signer, None) as service:  # nothing listens there
        key = service.create_key()
        response = service.post(alerts(key))
        assert_problem(response, 503, "signing_keys_unavailable")
        assert response.headers["retry-after"].isdigit()
        assert service.use(key).status_code == 200
        assert service.status_of(key) == "active"


def test_if_the_key_list_answers_an_error_then_503_and_nothing_revoked(
    tmp_path: Path, signer: Signer
) -> None:
    with (
        KeyListServer([signer.entry()]) as key_list,
        running_service(tmp_path, signer, key_list) as service,
    ):
        key_list.status = 500
        key = service.create_key()
        assert_problem(service.post(alerts(key)), 503, "signing_keys_unavailable")
        assert service.use(key).status_code == 200


# -- bodies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"not json", 400, "malformed_json"),
        (b"\xff\xfe", 400, "malformed_json"),
        (b"", 400, "malformed_json"),
        (b'{"token": "x"}', 400, "invalid_payload"),
        (b"[1]", 400, "invalid_payload"),
        (b'[{"token": "x", "type": "t"}]', 400, "invalid_payload"),  # no url
        (b'[{"token": 1, "type": "t", "url": ""}]', 400, "invalid_payload"),
        (b'[{"token": "", "type": "t", "url": ""}]', 400, "invalid_payload"),
        (b'[{"token": "x", "type": "t", "url": "", "source": 3}]', 400, "invalid_payload"),
        (b'[{"token": "\\ud800", "type": "t", "url": ""}]', 400, "invalid_payload"),
        (b'[{"token": "a\\u0000b", "type": "t", "url": ""}]', 400, "invalid_payload"),
        (
            json.dumps([{"token": "x" * 5000, "type": "t", "url": ""}]).encode(),
            400,
            "invalid_payload",
        ),
        (b'[{"token": "x", "token": "y", "type": "t", "url": ""}]', 400, "malformed_json"),
        (b"[NaN]", 400, "malformed_json"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "malformed_json"),
    ],
)
def test_if_a_signed_body_is_malformed_then_4xx_problem(
    service: Service, body: bytes, status: int, code: str
) -> None:
    assert_problem(service.post(body), status, code)


def test_if_too_many_alerts_then_400(service: Service) -> None:
    body = alerts(*["ak_x"] * (MAX_ALERTS + 1))
    problem = assert_problem(service.post(body), 400, "invalid_payload")
    assert str(MAX_ALERTS) in problem["errors"][0]["message"]


def test_if_not_json_then_415(service: Service) -> None:
    body = alerts(unknown_token())
    assert_problem(service.post(body, content_type="text/plain"), 415, "unsupported_media_type")


def test_if_over_one_mebibyte_then_413(service: Service) -> None:
    key = service.create_key()
    body = alerts(key) + b" " * MAX_BODY_BYTES
    assert_problem(service.post(body), 413, "payload_too_large")
    assert service.use(key).status_code == 200


def test_if_not_post_then_405(service: Service) -> None:
    response = httpx.get(f"{service.base_url}{PATH}", timeout=10)
    assert_problem(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "POST"


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=30),
        st.builds(lambda: unknown_token()),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(
                st.sampled_from(["token", "type", "url", "source", "x"]) | st.text(max_size=5),
                inner,
                max_size=5,
            ),
        ),
        max_leaves=20,
    )


_alert_items = st.fixed_dictionaries(
    {
        "token": st.one_of(st.text(max_size=90), st.builds(lambda: unknown_token())),
        "type": st.text(min_size=1, max_size=20),
        "url": st.text(max_size=40),
    },
    optional={"source": st.one_of(st.none(), st.text(max_size=10))},
)

bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda value: json.dumps(value).encode(), _json_values()),
    st.builds(
        lambda items, ascii: json.dumps(items, ensure_ascii=ascii).encode(),
        st.lists(_alert_items, max_size=5),
        st.booleans(),
    ),
)


@given(
    body=bodies,
    content_type=st.sampled_from(
        ["application/json", "application/json; charset=utf-8", "text/plain", ""]
    ),
)
@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_if_any_body_is_signed_then_never_a_500(
    service: Service, body: bytes, content_type: str
) -> None:
    response = service.post(body, content_type=content_type)
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        answer = response.json()
        assert isinstance(answer, list)
        for verdict in answer:
            assert set(verdict) == {"token_raw", "token_type", "label"}
            assert verdict["label"] == "false_positive"  # no real key in made-up bodies
    else:
        assert response.headers["content-type"] == PROBLEM
        assert 400 <= response.status_code < 500


@pytest.mark.parametrize(
    ("name", "value"),
    [("EXAMPLE_LEAK_ACTION", "delete"), ("EXAMPLE_GITHUB_KEYS_URL", "ftp://example.com/keys")],
)
def test_leak_settings_are_checked(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        Settings.from_env({name: value})


def test_leak_settings_default_to_github_and_revoke() -> None:
    settings = Settings.from_env({"EXAMPLE_LEAK_ACTION": "Disable"})
    assert settings.leak_action == "disable"
    assert Settings().github_keys_url == ("https://api.github.com/meta/public_keys/secret_scanning")
    assert Settings().leak_action == "revoke"


# -- the public bulk revoke ------------------------------------------------------------------


def test_anyone_can_report_leaked_keys_at_the_bulk_revoke_endpoint(service: Service) -> None:
    key, bystander = service.create_key(), service.create_key()
    real = parse_key(bystander)
    made_up = ParsedKey(real.prefix, real.id, generate_key().secret).token

    response = httpx.post(
        f"{service.base_url}/api/v1/credentials/revoke",
        json={"credentials": [key, made_up, unknown_token()]},
        timeout=30,
    )

    assert response.status_code == 202, response.text
    assert_problem(service.use(key), 401, "key_revoked")
    assert service.audit_of(key)[-1] == ("leak_revoked", "bulk-revoke")
    assert service.use(bystander).status_code == 200
    refused = httpx.post(
        f"{service.base_url}/api/v1/credentials/revoke",
        content=b"[1]",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert_problem(refused, 400, "invalid_payload")
