"""Leak response: keys found where they should not be are revoked, by whoever finds them.

- `files`: what `apikeys scan` reads, matches and revokes (the command line; needs `click`).
- `github`: `SecretScanningReceiver`, the ASGI app GitHub's secret scanning partner alerts
  are POSTed to, signature checked (needs `pip install 'apikeys[github]'`).
- `bulk`: `BulkRevoke`, a public GitHub-style endpoint taking a list of up to 1000 leaked
  keys, rate-limited per client, answering the same whatever the list holds.
- `verdicts`: the one rule all three follow: a key is acted on only when its secret is
  right, so a real (public) key id with a made-up secret never gets a key revoked.

```python
from apikeys.leaks import BulkRevoke, SecretScanningReceiver

app.mount("/github/secret-scanning", SecretScanningReceiver(manager))
app.mount("/credentials/revoke", BulkRevoke(manager))
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from apikeys.leaks.bulk import BulkRevoke
from apikeys.leaks.verdicts import LEAK_ACTIONS, LeakAction, Outcome, act_on_leak

if TYPE_CHECKING:
    from apikeys.leaks.github import GitHubKeys, SecretScanningReceiver

__all__ = [
    "LEAK_ACTIONS",
    "BulkRevoke",
    "GitHubKeys",
    "LeakAction",
    "Outcome",
    "SecretScanningReceiver",
    "act_on_leak",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: the GitHub receiver needs the `github` extra, the rest does not.
    if name in ("GitHubKeys", "SecretScanningReceiver"):
        from apikeys.leaks import github

        return getattr(github, name)
    raise AttributeError(f"module 'apikeys.leaks' has no attribute {name!r}")
