"""The `apikeys` command line (contract section 6), on a SQLite store in a temporary folder.

The commands run in-process through click's `CliRunner` (each one calls `asyncio.run`
itself, so these are plain sync tests); one test runs the installed console script.
Keys are checked with a `KeyManager` on the same SQLite file, the way the service would.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from apikeys import KeyManager, store_from_url
from apikeys.cli import keys as cli_module
from apikeys.cli import main
from apikeys.durations import MAX_DURATION, format_duration, parse_duration
from apikeys.errors import InvalidAPIKey, KeyDisabled, KeyExpired, KeyRevoked
from apikeys.keys import ParsedKey, generate_key, parse_key
from apikeys.leaks.files import ScanStats, read_text_file, walk
from apikeys.types import KeyRecord, UsageDelta
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

pytestmark = pytest.mark.sqlite

PEPPER = "SQ-SUvFjge0pjQ9upfz5ybw7QFrEa7gr-JnfSl7h7IA"
KEY_RE = re.compile(r"^ak_live_[0-9A-Za-z]{12}_[0-9A-Za-z]{32}[0-9A-Za-z]{6}$")
RECORD_FIELDS = {
    "id",
    "name",
    "workspace",
    "prefix",
    "access",
    "scopes",
    "status",
    "rate_limit",
    "rate_limits",
    "created_at",
    "expires_at",
    "last_used_at",
    "request_count",
    "revoked_at",
    "replaces",
    "replaced_by",
    "owner",
    "metadata",
    "allowed_ips",
    "credits",
    "credit_refill",
    "imported_prefix",
    "environment",
    "identity",
}
ISO_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI and the test's KeyManager hash with the same pepper, as CLI and service must.
    monkeypatch.setenv("APIKEYS_PEPPER", PEPPER)
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'k.db'}"


def run(store_url: str, *args: str, input: str | None = None) -> Result:
    """`apikeys --store store_url ARGS…`, in-process."""
    return CliRunner().invoke(main, ["--store", store_url, *args], input=input)


def ok(store_url: str, *args: str) -> Result:
    result = run(store_url, *args)
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return result


def create_key(store_url: str, *extra: str, name: str = "Zapier") -> dict[str, Any]:
    """Create a key with `--json`; the parsed object (`key` plus the record's fields)."""
    args = extra or ("--scope", "contacts:read")
    created: dict[str, Any] = json.loads(
        ok(store_url, "create", "--name", name, *args, "--json").stdout
    )
    return created


def show(store_url: str, key_id: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(ok(store_url, "show", key_id, "--json").stdout)
    return record


def verify(store_url: str, token: str) -> KeyRecord:
    """What the service would answer for `token`: its record, or the error."""

    async def check() -> KeyRecord:
        async with KeyManager(store_url) as manager:
            return await manager.verify(token, record_usage=False)

    return asyncio.run(check())


def refused_with_one_line(result: Result) -> str:
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


# -- create ---------------------------------------------------------------------------------


def test_create_prints_only_the_key_on_stdout(store_url: str) -> None:
    result = ok(store_url, "create", "--name", "Zapier", "--scope", "contacts:read")

    key = result.stdout.strip()
    assert result.stdout == key + "\n"
    assert KEY_RE.match(key)
    record = verify(store_url, key)
    assert record.name == "Zapier"
    assert record.workspace == "default"
    assert record.scopes == ("contacts:read",)
    # The summary names the key by id and masked form, never the key itself.
    assert record.id in result.stderr
    assert f"ak_live_{record.id}_…" in result.stderr
    assert "once" in result.stderr
    assert key not in result.stderr
    assert parse_key(key).secret not in result.stderr


def test_create_json_has_the_key_and_every_record_field(store_url: str) -> None:
    created = create_key(
        store_url,
        "--workspace",
        "acme",
        "--scope",
        "contacts:write",
        "--scope",
        "campaigns:trigger,contacts:read",
        "--rate-limit",
        "10/second",
        "--expires-in",
        "30d",
    )

    assert set(created) == {"key"} | RECORD_FIELDS
    assert KEY_RE.match(created["key"])
    assert created["id"] == parse_key(created["key"]).id
    assert created["prefix"] == f"ak_live_{created['id']}_…"
    assert created["workspace"] == "acme"
    assert created["access"] == "restricted"
    assert created["scopes"] == ["campaigns:trigger", "contacts:read", "contacts:write"]
    assert created["status"] == "active"
    assert created["rate_limit"] == "10/second"
    assert created["request_count"] == 0
    assert created["last_used_at"] is None
    assert created["revoked_at"] is None
    assert ISO_Z.match(created["created_at"])
    assert ISO_Z.match(created["expires_at"])
    lifetime = _utc(created["expires_at"]) - _utc(created["created_at"])
    assert lifetime == timedelta(days=30)


def test_create_full_access(store_url: str) -> None:
    created = create_key(store_url, "--full-access")
    assert created["access"] == "full"
    assert created["scopes"] == []
    assert created["rate_limit"] is None
    assert created["expires_at"] is None
    assert verify(store_url, created["key"]).access == "full"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--name", "x", "--full-access", "--scope", "contacts:read"], "--full-access"),
        (["--name", "x"], "--scope"),
        (["--scope", "contacts:read"], "--name"),
        (["--name", "x", "--full-access", "--expires-in", "30 days"], "duration"),
        (["--name", "x", "--full-access", "--expires-in", "0s"], "duration"),
        (["--name", "x", "--full-access", "--expires-in", "-1d"], "duration"),
        (["--name", "x", "--full-access", "--rate-limit", "lots"], "rate limit"),
        (["--name", "x", "--full-access", "--rate-limit", "0/minute"], "rate limit"),
        (["--name", "x", "--scope", "Contacts"], "scope"),
        (["--name", " ", "--full-access"], "name"),
    ],
)
def test_create_usage_errors_exit_2(store_url: str, args: list[str], message: str) -> None:
    result = run(store_url, "create", *args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert message in result.stderr
    assert result.stdout == ""
    assert json.loads(ok(store_url, "list", "--json").stdout) == []


# -- list and show --------------------------------------------------------------------------


def test_list_and_show_never_show_the_key(store_url: str) -> None:
    first = create_key(store_url, "--scope", "contacts:read", name="Zapier")
    second = create_key(store_url, "--full-access", "--workspace", "ops", name="Ops bot")
    secrets = [first["key"], second["key"], parse_key(first["key"]).secret]

    outputs = [
        ok(store_url, "list"),
        ok(store_url, "list", "--json"),
        ok(store_url, "list", "--workspace", "ops"),
        ok(store_url, "show", first["id"]),
        ok(store_url, "show", first["id"], "--json"),
    ]
    for result in outputs:
        for secret in secrets:
            assert secret not in result.stdout
            assert secret not in result.stderr

    table = outputs[0].stdout
    assert "Zapier" in table
    assert "Ops bot" in table
    assert f"ak_live_{first['id']}_…" in table
    assert "never" in table  # last used
    listed = json.loads(outputs[1].stdout)
    assert [item["id"] for item in listed] == [first["id"], second["id"]]
    assert all(set(item) == RECORD_FIELDS for item in listed)
    assert first["id"] not in outputs[2].stdout
    assert second["id"] in outputs[2].stdout
    assert f"ak_live_{first['id']}_…" in outputs[3].stdout
    assert json.loads(outputs[4].stdout) == {k: v for k, v in first.items() if k != "key"}


def test_list_empty_workspace(store_url: str) -> None:
    create_key(store_url)
    assert json.loads(ok(store_url, "list", "--workspace", "nobody", "--json").stdout) == []
    assert "No API keys" in ok(store_url, "list", "--workspace", "nobody").stdout


def test_list_shows_usage(store_url: str) -> None:
    created = create_key(store_url)

    async def use() -> None:
        async with KeyManager(store_url) as manager:
            for _ in range(3):
                await manager.verify(created["key"])

    asyncio.run(use())
    record = show(store_url, created["id"])
    assert record["request_count"] == 3
    assert ISO_Z.match(record["last_used_at"])
    assert ok(store_url, "list").stdout.splitlines()[1].split()[-1] == "3"


def test_show_accepts_a_full_key_without_echoing_it(store_url: str) -> None:
    created = create_key(store_url)
    result = ok(store_url, "show", created["key"], "--json")
    assert json.loads(result.stdout)["id"] == created["id"]
    assert created["key"] not in result.stdout + result.stderr


# -- state changes --------------------------------------------------------------------------


def test_disable_enable_revoke(store_url: str) -> None:
    created = create_key(store_url)
    key_id, key = created["id"], created["key"]

    assert "disabled" in ok(store_url, "disable", key_id).stdout
    assert show(store_url, key_id)["status"] == "disabled"
    with pytest.raises(KeyDisabled):
        verify(store_url, key)

    ok(store_url, "enable", key_id)
    assert show(store_url, key_id)["status"] == "active"
    assert verify(store_url, key).id == key_id

    result = ok(store_url, "revoke", key_id, "--yes")
    assert key_id in result.stdout
    record = show(store_url, key_id)
    assert record["status"] == "revoked"
    assert ISO_Z.match(record["revoked_at"])
    with pytest.raises(KeyRevoked):
        verify(store_url, key)
    # Revoked keys stay listed for audit; revoking again is harmless.
    assert key_id in ok(store_url, "list").stdout
    assert "already revoked" in ok(store_url, "revoke", key_id, "--yes").stdout


def test_enabling_a_revoked_key_is_refused(store_url: str) -> None:
    created = create_key(store_url)
    ok(store_url, "revoke", created["id"], "--yes")

    line = refused_with_one_line(run(store_url, "enable", created["id"]))
    assert "revoked" in line
    refused_with_one_line(run(store_url, "disable", created["id"]))
    assert "revoked" in refused_with_one_line(run(store_url, "roll", created["id"]))
    assert show(store_url, created["id"])["status"] == "revoked"


@pytest.mark.parametrize(
    "command",
    [["show"], ["disable"], ["enable"], ["revoke", "--yes"], ["roll"], ["show", "--json"]],
)
def test_unknown_id_is_refused(store_url: str, command: list[str]) -> None:
    create_key(store_url)
    unknown = generate_key().id
    result = run(store_url, command[0], unknown, *command[1:])
    line = refused_with_one_line(result)
    assert line == f"Error: no API key with id {unknown!r}"
    assert result.stdout == ""


def test_a_malformed_id_is_refused_as_unknown(store_url: str) -> None:
    assert "no API key with id 'nope'" in refused_with_one_line(run(store_url, "show", "nope"))
    # A mistyped key (bad checksum) is not echoed back.
    created = create_key(store_url)
    typo = created["key"][:-1] + ("A" if created["key"][-1] != "A" else "B")
    line = refused_with_one_line(run(store_url, "show", typo))
    assert typo not in line
    assert parse_key(created["key"]).secret not in line


def test_revoke_without_yes_is_refused_when_nobody_can_confirm(store_url: str) -> None:
    created = create_key(store_url)
    result = run(store_url, "revoke", created["id"])
    assert result.exit_code == 2
    assert "--yes" in result.stderr
    assert show(store_url, created["id"])["status"] == "active"


def test_revoke_asks_for_confirmation_on_a_terminal(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_module, "_interactive", lambda: True)
    created = create_key(store_url)

    declined = run(store_url, "revoke", created["id"], input="n\n")
    assert declined.exit_code == 1
    assert created["id"] in declined.stderr  # the prompt names the key
    assert "Zapier" in declined.stderr
    assert show(store_url, created["id"])["status"] == "active"

    accepted = run(store_url, "revoke", created["id"], input="y\n")
    assert accepted.exit_code == 0, accepted.stderr
    assert show(store_url, created["id"])["status"] == "revoked"


# -- roll -----------------------------------------------------------------------------------


def test_roll_prints_the_new_key_once_and_the_old_one_keeps_working(store_url: str) -> None:
    old = create_key(store_url, "--scope", "contacts:read", "--rate-limit", "5/second")
    before = datetime.now(UTC)

    result = ok(store_url, "roll", old["id"], "--grace", "2h")

    new_key = result.stdout.strip()
    assert result.stdout == new_key + "\n"
    assert KEY_RE.match(new_key)
    assert new_key not in result.stderr
    assert old["key"] not in result.stdout + result.stderr
    new = verify(store_url, new_key)
    assert new.id != old["id"]
    assert (new.name, new.workspace, new.scopes, new.rate_limit) == (
        "Zapier",
        "default",
        ("contacts:read",),
        "5/second",
    )
    # The old key works through the grace period, and the output says until when.
    assert verify(store_url, old["key"]).id == old["id"]
    old_record = show(store_url, old["id"])
    old_expiry = _utc(old_record["expires_at"])
    assert before + timedelta(hours=2) <= old_expiry <= datetime.now(UTC) + timedelta(hours=2)
    assert old_expiry.strftime("%Y-%m-%dT%H:%M:%SZ") in result.stderr
    assert "2h" in result.stderr
    # Each record names the other, in --json and in the human form.
    assert old_record["replaced_by"] == new.id
    assert show(store_url, new.id)["replaces"] == old["id"]
    assert f"replaced by: {new.id}" in ok(store_url, "show", old["id"]).stdout
    # The new key is never shown again.
    assert new_key not in ok(store_url, "list").stdout
    assert new_key not in ok(store_url, "show", new.id, "--json").stdout


def test_roll_with_zero_grace_cuts_the_old_key_off(store_url: str) -> None:
    old = create_key(store_url)
    rolled = json.loads(ok(store_url, "roll", old["id"], "--grace", "0", "--json").stdout)

    assert set(rolled) == {"key", "replaced"} | RECORD_FIELDS
    assert KEY_RE.match(rolled["key"])
    assert rolled["replaces"] == old["id"]
    assert rolled["replaced"]["id"] == old["id"]
    assert rolled["replaced"]["replaced_by"] == rolled["id"]
    assert rolled["replaced"]["status"] == "expired"
    with pytest.raises(KeyExpired):
        verify(store_url, old["key"])
    assert verify(store_url, rolled["key"]).id == rolled["id"]


def test_roll_expires_in(store_url: str) -> None:
    old = create_key(store_url)
    rolled = json.loads(ok(store_url, "roll", old["id"], "--expires-in", "1w", "--json").stdout)
    lifetime = _utc(rolled["expires_at"]) - _utc(rolled["created_at"])
    assert lifetime == timedelta(weeks=1)


@pytest.mark.parametrize(
    "args", [["--grace", "soon"], ["--grace", "-1h"], ["--expires-in", "0"], ["--grace", "1y"]]
)
def test_roll_bad_durations_exit_2(store_url: str, args: list[str]) -> None:
    old = create_key(store_url)
    result = run(store_url, "roll", old["id"], *args)
    assert result.exit_code == 2
    assert "duration" in result.stderr
    assert len(json.loads(ok(store_url, "list", "--json").stdout)) == 1


# -- scan -----------------------------------------------------------------------------------


def _tree(root: Path, key: str) -> Path:
    """A project with `key` in one nested file, and copies where scan must not look."""
    project = root / "project"
    (project / "src" / "app" / "config").mkdir(parents=True)
    (project / "src" / "app" / "config" / "settings.py").write_text(
        f'"""Settings."""\n\nDEBUG = False\n# the key\nAPI_KEY = "{key}"\n', encoding="utf-8"
    )
    (project / "README.md").write_text("Nothing to see here.\n", encoding="utf-8")
    for skipped in (".git", ".venv", "node_modules", "__pycache__"):
        (project / skipped).mkdir()
        (project / skipped / "leak.txt").write_text(f"{key}\n", encoding="utf-8")
    (project / "src" / "blob.bin").write_bytes(b"\x00\x01binary" + key.encode() + b"\n")
    return project


def _bad_checksum(key: str) -> str:
    return key[:-1] + ("A" if key[-1] != "A" else "B")


def test_scan_finds_a_key_in_a_nested_file(store_url: str, tmp_path: Path) -> None:
    created = create_key(store_url)
    project = _tree(tmp_path, created["key"])

    result = run(store_url, "scan", str(project))

    assert result.exit_code == 1, result.stderr
    settings = project / "src" / "app" / "config" / "settings.py"
    assert result.stdout == f"{settings}:5: ak_live_{created['id']}_…\n"
    assert created["key"] not in result.stdout + result.stderr
    assert parse_key(created["key"]).secret not in result.stdout + result.stderr
    # Scanning reports, it does not touch the key.
    assert show(store_url, created["id"])["status"] == "active"


def test_scan_reports_every_occurrence_with_its_line(tmp_path: Path, store_url: str) -> None:
    key = generate_key().token
    other = generate_key().token
    path = tmp_path / "notes.txt"
    path.write_text(f"{key}\n\n'{other}', x={key};\nnot{key}\n", encoding="utf-8")

    result = run(store_url, "scan", str(path))

    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        f"{path}:1: {parse_key(key).masked}",
        f"{path}:3: {parse_key(other).masked}",
        f"{path}:3: {parse_key(key).masked}",
    ]


def test_scan_ignores_noise_and_skipped_places(tmp_path: Path, store_url: str) -> None:
    key = generate_key().token
    project = tmp_path / "clean"
    (project / "src").mkdir(parents=True)
    (project / "src" / "noise.py").write_text(
        f"TOKEN = '{_bad_checksum(key)}'\nHASH = 'ak_short_abc'\n", encoding="utf-8"
    )
    for skipped in (".git", "node_modules"):
        (project / skipped).mkdir()
        (project / skipped / "config").write_text(key, encoding="utf-8")
    (project / "image.png").write_bytes(b"\x89PNG\x00\x00" + key.encode())

    result = run(store_url, "scan", str(project))

    assert result.exit_code == 0, result.stdout
    assert result.stdout == ""
    assert "No API keys found" in result.stderr


def test_scan_other_prefixes(tmp_path: Path, store_url: str) -> None:
    live = generate_key("sk_live").token
    path = tmp_path / "env"
    path.write_text(f"STRIPE_LIKE={live}\nAK={generate_key().token}\n", encoding="utf-8")

    result = run(store_url, "scan", str(path), "--prefix", "sk_live")
    assert result.exit_code == 1
    assert result.stdout == f"{path}:1: {parse_key(live).masked}\n"
    assert run(store_url, "scan", str(path), "--prefix", "BAD").exit_code == 2


def test_scan_reads_stdin(store_url: str) -> None:
    key = generate_key().token
    result = CliRunner().invoke(main, ["--store", store_url, "scan", "-"], input=f"x\n{key}\n")
    assert result.exit_code == 1
    assert result.stdout == f"<stdin>:2: {parse_key(key).masked}\n"


def test_scan_missing_path_is_a_usage_error(store_url: str, tmp_path: Path) -> None:
    assert run(store_url, "scan", str(tmp_path / "missing")).exit_code == 2


def test_scan_revoke(store_url: str, tmp_path: Path) -> None:
    created = create_key(store_url)
    bystander = create_key(store_url, name="bystander")
    # A token with a valid checksum and a real id but a made-up secret, and a stranger's key.
    forged = ParsedKey("ak_live", bystander["id"], generate_key().secret).token
    stranger = generate_key().token
    project = _tree(tmp_path, created["key"])
    (project / "forged.txt").write_text(f"{forged}\n{stranger}\n", encoding="utf-8")

    result = run(store_url, "scan", str(project), "--revoke")

    assert result.exit_code == 1
    outcomes = _verdicts(result.stdout)
    assert outcomes[f"ak_live_{created['id']}_…"] == "revoked"
    assert outcomes[f"ak_{parse_key(stranger).id}_…"] == "unknown id in this store"
    assert outcomes[f"ak_live_{bystander['id']}_…"].startswith("not revoked")
    with pytest.raises(KeyRevoked):
        verify(store_url, created["key"])
    # The forged token got nobody's key revoked.
    assert verify(store_url, bystander["key"]).id == bystander["id"]
    for secret in (created["key"], forged, stranger):
        assert secret not in result.stdout + result.stderr

    again = run(store_url, "scan", str(project), "--revoke")
    assert again.exit_code == 1
    assert f"ak_live_{created['id']}_…: already revoked" in again.stdout


def test_scan_revoke_follows_no_symlink_out_of_the_scanned_folder(
    store_url: str, tmp_path: Path
) -> None:
    # A folder someone else can write to (a checkout, an upload) holds links to a file and a
    # folder outside it, each holding a valid key: scanning the folder neither reports nor
    # revokes them, and says what it skipped.
    created = create_key(store_url)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secrets.env").write_text(f"KEY={created['key']}\n", encoding="utf-8")
    project = tmp_path / "project"
    project.mkdir()
    (project / "linked.env").symlink_to(outside / "secrets.env")
    (project / "linked-folder").symlink_to(outside, target_is_directory=True)
    (project / "clean.txt").write_text("nothing here\n", encoding="utf-8")

    result = run(store_url, "scan", str(project), "--revoke")

    assert result.exit_code == 0, result.stdout
    assert result.stdout == ""
    assert "skipped 2 symbolic links" in result.stderr
    assert verify(store_url, created["key"]).id == created["id"]


def test_scan_follows_no_symlink_inside_the_scanned_folder_either(
    store_url: str, tmp_path: Path
) -> None:
    # A link to a file in the same folder: not followed; the file is reported once, by its
    # own name.
    key = generate_key().token
    (tmp_path / "real.env").write_text(f"KEY={key}\n", encoding="utf-8")
    (tmp_path / "alias.env").symlink_to(tmp_path / "real.env")

    result = run(store_url, "scan", str(tmp_path))

    assert result.exit_code == 1
    assert result.stdout == f"{tmp_path / 'real.env'}:1: {parse_key(key).masked}\n"
    assert "skipped 1 symbolic link" in result.stderr


def test_scan_follows_no_file_swapped_for_a_symlink_during_the_walk(tmp_path: Path) -> None:
    # Listed as a regular file, replaced by a link before it is read: not followed.
    outside = tmp_path / "outside.env"
    outside.write_text(f"KEY={generate_key().token}\n", encoding="utf-8")
    project = tmp_path / "project"
    project.mkdir()
    (project / "a.env").write_text("nothing\n", encoding="utf-8")
    stats = ScanStats()
    walking = walk(str(project), stats)
    listed = next(walking)
    (project / "a.env").unlink()
    (project / "a.env").symlink_to(outside)

    assert read_text_file(listed, stats) is None
    assert (stats.links, stats.files) == (1, 0)
    walking.close()


def test_scan_reads_a_symlink_named_on_the_command_line(store_url: str, tmp_path: Path) -> None:
    # A path given explicitly is scanned, as the folders it skips are: the caller chose it.
    key = generate_key().token
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.env").write_text(f"KEY={key}\n", encoding="utf-8")
    (tmp_path / "file-link").symlink_to(real / "a.env")
    (tmp_path / "folder-link").symlink_to(real, target_is_directory=True)

    by_file = run(store_url, "scan", str(tmp_path / "file-link"))
    by_folder = run(store_url, "scan", str(tmp_path / "folder-link"))

    assert by_file.stdout == f"{tmp_path / 'file-link'}:1: {parse_key(key).masked}\n"
    assert by_folder.stdout == f"{tmp_path / 'folder-link' / 'a.env'}:1: {parse_key(key).masked}\n"


def _verdicts(stdout: str) -> dict[str, str]:
    """masked key -> verdict, from `scan --revoke` lines `file:line: masked: verdict`."""
    found = {}
    for line in stdout.splitlines():
        match = re.match(r"^.+:\d+: (ak_\w+_…): (.+)$", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def test_scan_revoke_names_the_file_and_line_of_every_verdict(
    store_url: str, tmp_path: Path
) -> None:
    # Two findings of one id: the real key in one file, a lookalike in another. Each verdict
    # says where its token was, so one can tell which file held the real key.
    created = create_key(store_url)
    lookalike = ParsedKey("ak_live", created["id"], generate_key().secret).token
    (tmp_path / "real.env").write_text(f"KEY={created['key']}\n", encoding="utf-8")
    (tmp_path / "notes.txt").write_text(f"\n\nsee {lookalike}\n", encoding="utf-8")

    result = run(store_url, "scan", str(tmp_path), "--revoke")

    verdicts = [line for line in result.stdout.splitlines() if line.count(": ") >= 2]
    assert f"{tmp_path / 'real.env'}:1: ak_live_{created['id']}_…: revoked" in verdicts
    assert any(
        line.startswith(f"{tmp_path / 'notes.txt'}:3: ak_live_{created['id']}_…: not revoked")
        for line in verdicts
    ), verdicts


def test_roll_keeps_the_lifetime_of_the_key_it_replaces(store_url: str) -> None:
    old = create_key(store_url, "--scope", "contacts:read", "--expires-in", "30d")
    result = ok(store_url, "roll", old["id"], "--grace", "24h", "--json")
    rolled = json.loads(result.stdout)
    lifetime = _utc(rolled["expires_at"]) - _utc(rolled["created_at"])
    assert timedelta(days=30) - timedelta(seconds=5) <= lifetime <= timedelta(days=30)

    said = ok(store_url, "roll", rolled["id"], "--grace", "24h").stderr
    assert "the same lifetime as the key it replaces" in said
    assert "(grace 24h)" in said  # the user's own units, not "1d"


def test_roll_of_a_key_that_never_expires_gives_one_that_never_does(store_url: str) -> None:
    old = create_key(store_url)
    result = ok(store_url, "roll", old["id"])
    assert "The new key does not expire." in result.stderr
    assert json.loads(ok(store_url, "list", "--json").stdout)[-1]["expires_at"] is None


def test_roll_expires_in_overrides_the_lifetime_and_says_so(store_url: str) -> None:
    old = create_key(store_url, "--scope", "contacts:read", "--expires-in", "30d")
    result = ok(store_url, "roll", old["id"], "--expires-in", "7d")
    assert "(in 7d)" in result.stderr


def test_a_second_disable_or_enable_says_nothing_changed(store_url: str) -> None:
    created = create_key(store_url)
    first = ok(store_url, "disable", created["id"]).stdout
    assert "it is now disabled" in first
    again = ok(store_url, "disable", created["id"]).stdout
    assert "was already disabled" in again
    assert "now" not in again
    ok(store_url, "enable", created["id"])
    assert "was already enabled" in ok(store_url, "enable", created["id"]).stdout


def test_list_filters_by_status(store_url: str) -> None:
    active = create_key(store_url, name="active")
    disabled = create_key(store_url, name="disabled")
    revoked = create_key(store_url, name="revoked")
    ok(store_url, "disable", disabled["id"])
    ok(store_url, "revoke", revoked["id"], "--yes")
    for status, expected in (
        ("active", [active["id"]]),
        ("disabled", [disabled["id"]]),
        ("revoked", [revoked["id"]]),
        ("expired", []),
    ):
        listed = json.loads(ok(store_url, "list", "--status", status, "--json").stdout)
        assert [item["id"] for item in listed] == expected, status
    assert "No expired API keys." in ok(store_url, "list", "--status", "expired").stdout
    assert run(store_url, "list", "--status", "gone").exit_code == 2


def test_list_pages_through_every_key_with_the_cursor_it_prints(store_url: str) -> None:
    made = [create_key(store_url, name=f"k{index}")["id"] for index in range(5)]
    ok(store_url, "revoke", made[1], "--yes")
    every = json.loads(ok(store_url, "list", "--json").stdout)

    for size in ("1", "2", "5"):
        pages: list[dict[str, Any]] = []
        cursor: list[str] = []
        while True:
            page = json.loads(ok(store_url, "list", "--limit", size, *cursor, "--json").stdout)
            assert set(page) == {"data", "next_cursor"}
            pages.append(page)
            if page["next_cursor"] is None:
                break
            cursor = ["--cursor", page["next_cursor"]]
        assert [item for page in pages for item in page["data"]] == every, size
        assert all(len(page["data"]) == int(size) for page in pages[:-1])

    text = ok(store_url, "list", "--limit", "2").stdout
    first_page = json.loads(ok(store_url, "list", "--limit", "2", "--json").stdout)
    assert text.splitlines()[-1] == f"Next page: --cursor {first_page['next_cursor']}"
    assert made[0] in text
    assert made[2] not in text
    last = ok(store_url, "list", "--cursor", first_page["next_cursor"], "--limit", "3").stdout
    assert made[4] in last
    assert "Next page" not in last


def test_list_filters_by_owner_and_status_on_every_page(store_url: str) -> None:
    ann = [
        create_key(store_url, "--full-access", "--owner", "ann@example.com")["id"] for _ in "abc"
    ]
    create_key(store_url, "--full-access", "--owner", "bob")
    create_key(store_url)
    ok(store_url, "disable", ann[1])

    listed = json.loads(ok(store_url, "list", "--owner", "ann@example.com", "--json").stdout)
    assert [item["id"] for item in listed] == ann
    active = json.loads(
        ok(
            store_url,
            "list",
            "--owner",
            "ann@example.com",
            "--status",
            "active",
            "--limit",
            "1",
            "--json",
        ).stdout
    )
    assert [item["id"] for item in active["data"]] == [ann[0]]
    following = json.loads(
        ok(
            store_url,
            "list",
            "--owner",
            "ann@example.com",
            "--status",
            "active",
            "--cursor",
            active["next_cursor"],
            "--json",
        ).stdout
    )
    assert following == {"data": [show(store_url, ann[2])], "next_cursor": None}
    assert "No API keys of owner 'carol'." in ok(store_url, "list", "--owner", "carol").stdout


@pytest.mark.parametrize("cursor", ["", "garbage", "MS4xLg", "Mi4xLmFiYw", "ak_" + "x" * 300, "é"])
def test_list_with_a_bad_cursor_is_a_usage_error_in_one_line(store_url: str, cursor: str) -> None:
    create_key(store_url)
    result = run(store_url, "list", "--cursor", cursor)
    assert result.exit_code == 2, result.stdout
    assert "invalid cursor" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("limit", ["0", "1001", "-1", "ten"])
def test_list_with_a_bad_limit_is_a_usage_error(store_url: str, limit: str) -> None:
    assert run(store_url, "list", "--limit", limit).exit_code == 2


# -- store selection and failures -----------------------------------------------------------


def test_store_url_from_the_environment(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'from-env.db'}"
    result = CliRunner().invoke(
        main, ["create", "--name", "env", "--full-access"], env={"APIKEYS_STORE_URL": url}
    )
    assert result.exit_code == 0, result.stderr
    assert verify(url, result.stdout.strip()).name == "env"
    listed = CliRunner().invoke(main, ["list", "--json"], env={"APIKEYS_STORE_URL": url})
    assert [item["name"] for item in json.loads(listed.stdout)] == ["env"]


def test_an_unreachable_store_is_refused_in_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'k.db'}"
    line = refused_with_one_line(run(url, "list"))
    assert line.startswith("Error: key store unavailable: ")


def test_the_store_password_is_never_shown() -> None:
    pytest.importorskip("asyncpg")
    url = "postgresql://bob:pa%24%24word-xyz@127.0.0.1:1/keys"
    line = refused_with_one_line(run(url, "list"))
    assert "key store unavailable" in line
    assert "postgresql://bob:***@127.0.0.1:1/keys" in line
    assert "word-xyz" not in line


def test_an_unknown_store_scheme_is_a_usage_error() -> None:
    result = run("ftp://example.com/keys", "list")
    assert result.exit_code == 2
    assert "ftp://" in result.stderr


# -- durations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", timedelta(seconds=90)),
        ("15m", timedelta(minutes=15)),
        ("24h", timedelta(hours=24)),
        ("30d", timedelta(days=30)),
        ("2w", timedelta(weeks=2)),
        ("1d12h", timedelta(days=1, hours=12)),
        (" 7D ", timedelta(days=7)),
    ],
)
def test_parse_duration(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected
    assert parse_duration(format_duration(expected)) == expected


@pytest.mark.parametrize(
    "text", ["", "30", "d", "1.5h", "-1d", "1h1d", "0s", "0", "1y", "1d 12", "99999999999d"]
)
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def test_parse_duration_zero_and_bounds() -> None:
    assert parse_duration("0", allow_zero=True) == timedelta(0)
    assert parse_duration("0s", allow_zero=True) == timedelta(0)
    assert parse_duration(f"{MAX_DURATION.days}d") == MAX_DURATION
    with pytest.raises(ValueError, match="at most"):
        parse_duration(f"{MAX_DURATION.days + 1}d")
    assert format_duration(timedelta(days=30)) == "30d"
    assert format_duration(timedelta(0)) == "0s"


# -- the installed console script -----------------------------------------------------------


def _console_script() -> str:
    candidate = Path(sys.executable).parent / ("apikeys.exe" if os.name == "nt" else "apikeys")
    found = str(candidate) if candidate.exists() else shutil.which("apikeys")
    if found is None:
        pytest.skip("the apikeys console script is not installed (pip install -e '.[cli]')")
    return found


def test_the_console_script(tmp_path: Path) -> None:
    script = _console_script()
    url = f"sqlite:///{tmp_path / 'script.db'}"
    env = {**os.environ, "APIKEYS_STORE_URL": url, "APIKEYS_PEPPER": PEPPER}

    def apikeys(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [script, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )

    created = apikeys("create", "--name", "svc", "--scope", "contacts:read", "--json")
    assert created.returncode == 0, created.stderr
    data = json.loads(created.stdout)
    assert KEY_RE.match(data["key"])
    assert verify(url, data["key"]).name == "svc"

    listed = apikeys("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [item["id"] for item in json.loads(listed.stdout)] == [data["id"]]
    assert data["key"] not in listed.stdout

    revoked = apikeys("revoke", data["id"], "--yes")
    assert revoked.returncode == 0, revoked.stderr
    refused = apikeys("enable", data["id"])
    assert refused.returncode == 1
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "Traceback" not in refused.stderr
    assert apikeys("create", "--name", "x").returncode == 2
    with pytest.raises(KeyRevoked):
        verify(url, data["key"])
    with pytest.raises(InvalidAPIKey):
        verify(url, ParsedKey("ak_live", data["id"], generate_key().secret).token)


@pytest.mark.postgres
def test_if_store_database_is_missing_then_one_line_without_password(postgres_url: str) -> None:
    base = postgres_url.rsplit("/", 1)[0].replace("postgres@", "postgres:hunter2-secret@")
    result = run(f"{base}/apikeys_no_such_database", "list")
    assert result.exit_code == 1
    line = refused_with_one_line(result)
    assert "does not exist" in line
    assert "hunter2-secret" not in result.output + (result.stderr or "")


def test_without_click_the_command_names_the_extra_to_install() -> None:
    code = "import sys; sys.modules['click'] = None\nfrom apikeys.__main__ import main\nmain()\n"
    result = subprocess.run(
        [sys.executable, "-c", code, "list"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "pip install 'apikeys[cli]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_apikeys_command_runs_through_the_entry_point(store_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "apikeys", "--store", store_url, "list"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "No API keys." in result.stdout


def test_a_command_on_sqlite_loads_neither_the_middleware_nor_starlette_nor_asyncpg(
    tmp_path: Path,
) -> None:
    # `import apikeys` imports a name's module when it is first used: a command starts
    # without the request path's modules.
    code = (
        "import runpy, sys\n"
        "try:\n"
        "    runpy.run_module('apikeys', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "print(sorted({'apikeys.middleware', 'apikeys.gate', 'starlette', 'asyncpg'}"
        " & set(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "--store", f"sqlite:///{tmp_path / 'keys.db'}", "list"],
        env={**os.environ, "APIKEYS_PEPPER": PEPPER},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["No API keys.", "[]"]


def test_update_edits_a_key_and_refuses_a_revoked_one(store_url: str) -> None:
    created = create_key(store_url)
    updated = json.loads(
        ok(
            store_url,
            "update",
            created["id"],
            "--name",
            "renamed",
            "--scope",
            "contacts:read,campaigns:read",
            "--rate-limit",
            "5/second",
            "--expires-in",
            "30d",
            "--json",
        ).stdout
    )
    assert updated["name"] == "renamed"
    assert updated["scopes"] == ["campaigns:read", "contacts:read"]
    assert updated["rate_limit"] == "5/second"
    assert updated["expires_at"] is not None
    back = json.loads(
        ok(
            store_url, "update", created["id"], "--default-rate-limit", "--no-expiry", "--json"
        ).stdout
    )
    assert (back["rate_limit"], back["expires_at"]) == (None, None)
    assert run(store_url, "update", created["id"]).exit_code == 2  # nothing to change
    assert run(store_url, "update", created["id"], "--full-access", "--scope", "a:b").exit_code == 2
    ok(store_url, "revoke", created["id"], "--yes")
    refused = run(store_url, "update", created["id"], "--name", "again")
    assert refused.exit_code == 1
    assert "revoked" in refused.stderr


def test_policies_are_set_shown_and_cleared_from_the_command_line(store_url: str) -> None:
    created = create_key(
        store_url,
        "--full-access",
        "--owner",
        "user_42",
        "--metadata",
        '{"plan": "pro"}',
        "--allow-ip",
        "10.0.0.0/8",
        "--allow-ip",
        "2001:db8::1",
        "--credits",
        "5",
    )
    assert created["owner"] == "user_42"
    assert created["metadata"] == {"plan": "pro"}
    assert created["allowed_ips"] == ["10.0.0.0/8", "2001:db8::1/128"]
    assert created["credits"] == 5
    shown = ok(store_url, "show", created["id"]).stdout
    assert "owner:       user_42" in shown
    assert "allowed IPs: 10.0.0.0/8, 2001:db8::1/128" in shown
    assert "credits:     5" in shown

    ok(store_url, "update", created["id"], "--credit-refill", "100/day", "--no-metadata")
    record = show(store_url, created["id"])
    assert (record["credits"], record["credit_refill"], record["metadata"]) == (100, "100/day", {})
    ok(store_url, "update", created["id"], "--any-ip", "--unlimited", "--no-owner")
    record = show(store_url, created["id"])
    assert (record["allowed_ips"], record["credits"], record["credit_refill"]) == ([], None, None)
    assert record["owner"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metadata", "[1, 2]"], "JSON object"),
        (["--metadata", "{oops"], "not JSON"),
        (["--metadata", json.dumps({"x": "y" * 5000})], "at most 4096"),
        (["--allow-ip", "10.0.0.1/8"], "10.0.0.0/8"),
        (["--credits", "-1"], "-1"),
        (["--credit-refill", "5/week"], "1000/day"),
        (["--owner", "me", "--no-owner"], "exclude each other"),
    ],
)
def test_bad_policies_exit_2_and_change_nothing(
    store_url: str, args: list[str], message: str
) -> None:
    created = create_key(store_url, "--full-access")
    result = run(store_url, "update", created["id"], *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    record = show(store_url, created["id"])
    assert (record["metadata"], record["allowed_ips"], record["credits"]) == ({}, [], None)


def test_audit_shows_who_changed_a_key_with_the_actor_given_or_the_os_user(
    store_url: str,
) -> None:
    created = create_key(store_url, "--full-access", "--actor", "ops-bot")
    ok(store_url, "update", created["id"], "--name", "renamed", "--actor", "Jane Doe")
    ok(store_url, "disable", created["id"])
    ok(store_url, "revoke", created["id"], "--yes", "--actor", "Jane Doe")
    events = json.loads(ok(store_url, "audit", "--key", created["id"], "--json").stdout)
    assert [(e["action"], e["actor"]) for e in events] == [
        ("created", "ops-bot"),
        ("updated", "Jane Doe"),
        ("disabled", f"cli:{getpass.getuser()}"),
        ("revoked", "Jane Doe"),
    ]
    assert events[1]["changes"] == {"name": "renamed"}
    assert all(
        set(event) == {"time", "key_id", "workspace", "action", "actor", "changes"}
        for event in events
    )
    assert created["key"] not in json.dumps(events)
    table = ok(store_url, "audit", "--since", "1h").stdout
    assert "Jane Doe" in table
    assert "revoked" in table
    assert json.loads(ok(store_url, "audit", "--workspace", "elsewhere", "--json").stdout) == []
    assert run(store_url, "audit", "--since", "soon").exit_code == 2


def test_scan_revoke_records_leak_revoked_events(store_url: str, tmp_path: Path) -> None:
    created = create_key(store_url, "--full-access")
    (tmp_path / "settings.py").write_text(f'KEY = "{created["key"]}"\n')
    result = run(store_url, "scan", str(tmp_path), "--revoke", "--actor", "pre-commit")
    assert result.exit_code == 1
    events = json.loads(ok(store_url, "audit", "--key", created["id"], "--json").stdout)
    assert [(e["action"], e["actor"]) for e in events][-1] == ("leak_revoked", "pre-commit")


def test_usage_shows_a_key_s_requests_per_day_admitted_and_refused(store_url: str) -> None:
    created = create_key(store_url, "--full-access")
    today = datetime.now(UTC).date()

    async def traffic() -> None:
        store = store_from_url(store_url)
        try:
            await store.add_usage(
                {
                    created["id"]: UsageDelta(
                        4,
                        datetime.now(UTC),
                        {
                            (today.isoformat(), "admitted"): 3,
                            (today.isoformat(), "rate_limited"): 1,
                            ((today - timedelta(days=1)).isoformat(), "admitted"): 0,
                        },
                    )
                },
                batch_id="cli-usage",
            )
        finally:
            await store.aclose()

    asyncio.run(traffic())
    report = json.loads(ok(store_url, "usage", created["id"], "--days", "3", "--json").stdout)
    assert report["key_id"] == created["id"]
    assert (report["admitted"], report["refused"]) == (3, 1)
    assert [day["day"] for day in report["days"]] == [
        (today - timedelta(days=n)).isoformat() for n in (2, 1, 0)
    ]
    assert report["days"][-1] == {
        "day": today.isoformat(),
        "admitted": 3,
        "refused": {"rate_limited": 1},
        "legacy_scheme": 0,
    }
    table = ok(store_url, "usage", created["id"], "--days", "2").stdout
    assert "rate_limited" in table
    assert "Total: 3 admitted, 1 refused." in table
    assert run(store_url, "usage", created["id"], "--days", "0").exit_code == 2
    assert run(store_url, "usage", "AAAAAAAAAAAA").exit_code == 1


def test_if_the_environment_names_the_store_then_a_bare_manager_finds_the_cli_keys(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `KeyManager()` reads what the CLI reads: APIKEYS_STORE_URL, APIKEYS_PEPPER and
    # APIKEYS_OLD_PEPPERS. A key the CLI made is found by the app with no argument at all,
    # also after the pepper was rotated.
    monkeypatch.setenv("APIKEYS_STORE_URL", store_url)
    result = CliRunner().invoke(main, ["create", "--name", "n", "--scope", "a:read", "--json"])
    assert result.exit_code == 0, result.output
    created = json.loads(result.stdout)
    monkeypatch.setenv("APIKEYS_PEPPER", "zp6GZXHuQzbesamcB88YLQpwFCw29vdTknZdQyDertY")
    monkeypatch.setenv("APIKEYS_OLD_PEPPERS", PEPPER)

    async def check() -> KeyRecord:
        async with KeyManager() as manager:
            return await manager.verify(created["key"], record_usage=False)

    assert asyncio.run(check()).id == created["id"]


def test_if_the_environment_names_no_store_then_a_bare_manager_keeps_keys_in_memory() -> None:
    assert type(KeyManager().store).__name__ == "MemoryStore"


def test_scan_revoke_checks_keys_hashed_with_a_pepper_in_apikeys_old_peppers(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/concepts/hashing.md: the command line reads APIKEYS_OLD_PEPPERS too, so after a
    # pepper rotation it still recognises (and revokes) a key hashed with the old pepper.
    created = create_key(store_url)
    monkeypatch.setenv("APIKEYS_PEPPER", "lRdVQldJRqWhOX8A7B-h-u7cp10iKRh4mWnxhvX5cyQ")
    monkeypatch.setenv("APIKEYS_OLD_PEPPERS", PEPPER)
    (tmp_path / "leak.txt").write_text(created["key"] + "\n", encoding="utf-8")
    result = run(store_url, "scan", str(tmp_path / "leak.txt"), "--revoke")
    assert _verdicts(result.stdout)[f"ak_live_{created['id']}_…"] == "revoked"


def test_if_the_cli_has_another_pepper_than_the_store_then_create_refuses_in_one_line(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keys made with the wrong pepper would be invalid_api_key for the service, silently.
    create_key(store_url)
    monkeypatch.setenv("APIKEYS_PEPPER", "k1yWcsiGHUDirgcIIg2cXh0VaSlqmdyUXjPxJBSJJb4")
    result = run(store_url, "create", "--name", "wrong", "--scope", "a:read")
    assert result.exit_code == 1
    line = refused_with_one_line(result)
    assert "another pepper" in line
    assert "k1yWcsiGHUDirgcIIg2cXh0VaSlqmdyUXjPxJBSJJb4" not in result.output
    # Commands that neither hash nor check a secret still work.
    ok(store_url, "list")


def test_a_rolled_pair_shows_and_spends_one_balance(store_url: str) -> None:
    old = create_key(store_url, "--scope", "contacts:read", "--credits", "100")

    async def spend(key_id: str, cost: int) -> int | None:
        async with KeyManager(store_url) as manager:
            return await manager.spend_credits(await manager.get(key_id), cost)

    assert asyncio.run(spend(old["id"], 40)) == 60
    rolled = json.loads(ok(store_url, "roll", old["id"], "--grace", "24h", "--json").stdout)
    assert (rolled["credits"], rolled["replaced"]["credits"]) == (60, 60)
    assert asyncio.run(spend(old["id"], 10)) == 50
    assert (show(store_url, old["id"])["credits"], show(store_url, rolled["id"])["credits"]) == (
        50,
        50,
    )
    listed = json.loads(ok(store_url, "list", "--json").stdout)
    assert [record["credits"] for record in listed] == [50, 50]
    refused = run(store_url, "update", old["id"], "--credits", "1000")
    assert refused.exit_code == 1
    assert rolled["id"] in refused_with_one_line(refused)
    ok(store_url, "update", rolled["id"], "--credits", "7")
    assert show(store_url, old["id"])["credits"] == 7


def test_the_helpers_the_commands_share_are_exported_and_documented() -> None:
    # The command modules import these from cli/common.py, so they are its public names.
    assert_all_is_complete("apikeys.cli.common")
    assert_exports_are_documented("apikeys.cli.common")
