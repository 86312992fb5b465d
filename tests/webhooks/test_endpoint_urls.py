"""What `apikeys webhooks add` takes as an endpoint URL: one an HTTP client can send to,
shown on one line by `list`. Anything else is a usage error (exit status 2) when it is
added, never an endpoint whose every delivery fails, nor an error blamed on the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from apikeys.cli import main
from apikeys.errors import InvalidKeyParameters
from apikeys.webhooks.admin import validate_url

REFUSED = [
    "http://[::1",  # an IPv6 host without its closing bracket
    "http://hooks.example.com:99999/x",
    "http://hooks.example.com:port/x",
    "http://exa mple.com/hooks",
    "http://hooks.example.com/a b",
    "http://hooks.example.com/\r\nX-Injected: 1",
    "http://hooks.example.com/\x00",
    "http://%00/hooks",
    "http://hooks.exämple.com/",  # IDNA hosts are given in their xn-- form
    "https://hooks.example.com/" + "a" * 3000,
]

ACCEPTED = [
    "https://hooks.example.com/apikeys?source=acme",
    "http://127.0.0.1:8080/hooks",
    "http://[::1]:8080/hooks",
    "http://hooks_receiver:8000/x",  # a container's service name
    "https://xn--hooks-exmple-ocb.com/",
    "  https://hooks.example.com/  ",
]


@pytest.mark.parametrize("url", REFUSED)
def test_a_url_no_client_could_send_to_is_refused(url: str) -> None:
    with pytest.raises(InvalidKeyParameters, match="webhook URL"):
        validate_url(url)


@pytest.mark.parametrize("url", ACCEPTED)
def test_an_http_url_with_a_host_is_accepted(url: str) -> None:
    assert validate_url(url) == url.strip()


def run(store: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--store", store, "webhooks", *args])


@pytest.mark.sqlite
def test_cli_add_refuses_each_as_a_usage_error_and_adds_nothing(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'keys.db'}"
    for url in REFUSED:
        result = run(store, "add", url)
        assert result.exit_code == 2, (url, result.output)
        assert "webhook URL" in result.output
        assert "key store" not in result.output
    assert json.loads(run(store, "list", "--json").output) == []
