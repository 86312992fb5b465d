"""GitHub's side of secret scanning, for tests: a signing key pair, its key list, alerts.

`Signer` makes a P-256 key pair and signs bodies as GitHub does; `KeyListServer` serves
`{"public_keys": [...]}` from a thread on loopback (or an error), counting fetches.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

__all__ = ["TOKEN_TYPE", "KeyListServer", "Signer", "alerts"]

TOKEN_TYPE = "apikeys_api_key"


@dataclass
class Signer:
    """A P-256 key pair, listed by the key-list server under `identifier`."""

    private: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )

    @property
    def pem(self) -> str:
        return (
            self.private.public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode()
        )

    @property
    def identifier(self) -> str:
        der = self.private.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return hashlib.sha256(der).hexdigest()

    def entry(self, *, current: bool = True) -> dict[str, Any]:
        return {"key_identifier": self.identifier, "key": self.pem, "is_current": current}

    def sign(self, body: bytes) -> str:
        return base64.b64encode(self.private.sign(body, ec.ECDSA(hashes.SHA256()))).decode()

    def headers(self, body: bytes, identifier: str | None = None) -> dict[str, str]:
        return {
            "Github-Public-Key-Identifier": identifier or self.identifier,
            "Github-Public-Key-Signature": self.sign(body),
        }


class KeyListServer:
    """`GET /` answers `{"public_keys": keys}` (or `status` with junk); counts fetches."""

    def __init__(self, keys: list[dict[str, Any]]) -> None:
        self.keys = keys
        self.status = 200
        self.fetches = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.fetches += 1
                if owner.status == 200:
                    body = json.dumps({"public_keys": owner.keys}).encode()
                else:
                    body = b"oops"
                self.send_response(owner.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/meta/public_keys"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> KeyListServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def alerts(*tokens: str, token_type: str = TOKEN_TYPE) -> bytes:
    """A body as GitHub sends it: compact JSON, one alert per token."""
    return json.dumps(
        [
            {
                "token": token,
                "type": token_type,
                "url": "https://github.com/octocat/Hello-World/blob/12345600b9cb/foo/bar.txt",
                "source": "content",
            }
            for token in tokens
        ],
        separators=(",", ":"),
    ).encode()
