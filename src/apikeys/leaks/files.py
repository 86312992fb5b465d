"""Finding API keys in files: what `apikeys scan` reads, matches and revokes (needs `click`).

A token counts when it has the key format of one of the prefixes looked for and a valid
checksum (the CRC32 tells a real key from noise). Files are read as bytes, binary and very
large ones skipped; a key found is reported by file, line and masked form, never its secret.
`revoke_found` revokes only keys whose secret the store confirms.

A walk follows no symbolic link, to a file or a folder, inside the folder or out of it: a
link in a folder someone else can write to (a checkout, an upload) must not make `scan
--revoke` read, report and revoke keys from files outside what was asked. A path named
explicitly is read as named, link or not. Folders are walked by descriptor (`os.fwalk`) and
files opened relative to them with `O_NOFOLLOW`, so a folder or file swapped for a link
during the walk is not followed either.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

import click

from apikeys.errors import (
    AuthenticationError,
    InvalidAPIKey,
    KeyDisabled,
    KeyExpired,
    KeyNotFound,
    KeyRevoked,
    MalformedAPIKey,
    StoreUnavailable,
)
from apikeys.keys import (
    CHECKSUM_LENGTH,
    ID_LENGTH,
    SECRET_LENGTH,
    ParsedKey,
    environments_of,
    manager_prefix,
    parse_key,
)
from apikeys.manager import KeyManager

__all__ = [
    "SCAN_MAX_BYTES",
    "SCAN_SKIP_DIRS",
    "SCAN_SNIFF_BYTES",
    "Finding",
    "ScanFile",
    "ScanStats",
    "find_keys",
    "key_pattern",
    "read_text_file",
    "revoke_found",
    "walk",
    "warn",
]

SCAN_MAX_BYTES = 10 * 1024 * 1024
"""Files larger than this are skipped by `scan`."""
SCAN_SNIFF_BYTES = 8 * 1024
"""A NUL byte in this many leading bytes marks a file as binary, which `scan` skips."""
SCAN_SKIP_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".venv",
        "node_modules",
        "__pycache__",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        ".tox",
        ".nox",
    }
)
"""Directories `scan` does not enter while walking (a path given explicitly is scanned)."""


@dataclass(frozen=True, slots=True)
class Finding:
    path: str
    line: int
    key: ParsedKey = field(repr=False)


@dataclass(slots=True)
class ScanStats:
    files: int = 0
    skipped: int = 0
    links: int = 0
    seen: set[tuple[int, int]] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class ScanFile:
    """A file to read: `path` as shown; met while walking, it is `name` in the open folder
    `dir_fd` (valid until the walk goes on), opened without following a link."""

    path: str
    dir_fd: int | None = None
    name: str | None = None


_READ_FLAGS: Final = (
    os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)  # a FIFO: no hang
)
_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
# What opening a symbolic link with O_NOFOLLOW fails with (Linux, macOS: ELOOP; FreeBSD: EMLINK).
_LINK_ERRORS: Final = frozenset({errno.ELOOP, errno.EMLINK})


def key_pattern(prefixes: Iterable[str]) -> re.Pattern[bytes]:
    """Tokens in the key format of managers of these prefixes (`ak`: `ak_live_…`,
    `ak_test_…` and the bare `ak_…`), not glued to other letters or digits."""
    every = {read for prefix in prefixes for read in environments_of(prefix)}
    alternatives = b"|".join(
        re.escape(prefix.encode("ascii")) for prefix in sorted(every, key=len, reverse=True)
    )
    return re.compile(
        rb"(?<![0-9A-Za-z])(?:"
        + alternatives
        + rb")_[0-9A-Za-z]{%d}_[0-9A-Za-z]{%d}(?![0-9A-Za-z])"
        % (ID_LENGTH, SECRET_LENGTH + CHECKSUM_LENGTH)
    )


def warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def walk(path: str, stats: ScanStats) -> Iterator[ScanFile]:
    """`path` itself, or the files under it, skipping `SCAN_SKIP_DIRS` and every symbolic
    link (counted in `stats.links`)."""
    if path == "-" or not os.path.isdir(path):
        yield ScanFile(path)
        return

    def report(error: OSError) -> None:
        warn(f"cannot read {click.format_filename(error.filename or path)}: {error.strerror}")

    if not hasattr(os, "fwalk"):  # pragma: no cover - not POSIX
        yield from _walk_by_name(path, stats, report)
        return
    try:
        # The folder named is opened as named (a link included): the caller chose it.
        top = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as error:
        report(error)
        return
    try:
        for folder, dirs, files, dir_fd in os.fwalk(".", dir_fd=top, onerror=report):
            shown = path if folder == "." else os.path.join(path, folder[2:])
            dirs[:] = _folders_to_enter(dirs, stats, dir_fd)
            for name in sorted(files):
                yield ScanFile(os.path.join(shown, name), dir_fd, name)
    finally:
        os.close(top)


def _folders_to_enter(names: list[str], stats: ScanStats, dir_fd: int) -> list[str]:
    kept = []
    for name in sorted(names):
        if name in SCAN_SKIP_DIRS:
            continue
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            continue  # gone since it was listed
        if link:
            stats.links += 1
        else:
            kept.append(name)
    return kept


def _walk_by_name(  # pragma: no cover - not POSIX
    path: str, stats: ScanStats, report: Callable[[OSError], None]
) -> Iterator[ScanFile]:
    for root, dirs, files in os.walk(path, onerror=report):
        links = {name for name in dirs if os.path.islink(os.path.join(root, name))}
        stats.links += len(links)
        dirs[:] = sorted(name for name in dirs if name not in SCAN_SKIP_DIRS | links)
        for name in sorted(files):
            if os.path.islink(os.path.join(root, name)):
                stats.links += 1
            else:
                yield ScanFile(os.path.join(root, name), None, None)


def read_text_file(file: ScanFile, stats: ScanStats) -> bytes | None:
    """The bytes of a regular, not too large, not binary file not read before; else None."""
    if file.path == "-":
        data = sys.stdin.buffer.read(SCAN_MAX_BYTES + 1)
    else:
        try:
            data_or_none = _read_regular(file, stats)
        except OSError as exc:
            warn(f"cannot read {click.format_filename(file.path)}: {exc.strerror or exc}")
            return None
        if data_or_none is None:
            return None
        data = data_or_none
    if len(data) > SCAN_MAX_BYTES or b"\0" in data[:SCAN_SNIFF_BYTES]:
        stats.skipped += 1
        return None
    stats.files += 1
    return data


def _read_regular(file: ScanFile, stats: ScanStats) -> bytes | None:
    try:
        if file.name is None:
            descriptor = os.open(file.path, _READ_FLAGS)
        else:
            descriptor = os.open(file.name, _READ_FLAGS | _NOFOLLOW, dir_fd=file.dir_fd)
    except OSError as exc:
        if file.name is not None and exc.errno in _LINK_ERRORS:
            stats.links += 1
            return None
        raise
    with open(descriptor, "rb") as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            return None
        identity = (info.st_dev, info.st_ino)
        if identity in stats.seen:
            return None
        stats.seen.add(identity)
        if info.st_size > SCAN_MAX_BYTES:
            stats.skipped += 1
            return None
        return handle.read(SCAN_MAX_BYTES + 1)


def find_keys(data: bytes, pattern: re.Pattern[bytes]) -> Iterator[tuple[int, ParsedKey]]:
    """(line number, key) for each token in `data` with a valid checksum."""
    line, counted_to = 1, 0
    for match in pattern.finditer(data):
        try:
            parsed = parse_key(match.group().decode("ascii"))
        except MalformedAPIKey:
            continue  # the right shape, a wrong checksum: noise
        line += data.count(b"\n", counted_to, match.start())
        counted_to = match.start()
        yield line, parsed


async def revoke_found(
    manager: KeyManager, keys: Sequence[ParsedKey], *, actor: str | None = None
) -> dict[str, str]:
    """Revoke each key whose secret this store confirms; the outcome of each, by token.

    The secret is checked first: a key id is public, so a planted token with a valid
    checksum but a made-up secret must not get someone else's key revoked.
    """
    # `verify` checks the manager's own prefixes: one checker per manager prefix (`ak` for
    # `ak_live_…` and `ak_test_…`), on the same store. Without a cache and recording no
    # usage, they hold nothing of their own to close.
    checkers: dict[str, KeyManager] = {manager.prefix: manager}
    try:
        return await _revoke_found(manager, keys, checkers, actor)
    finally:
        for checker in checkers.values():
            if checker is not manager:
                checker._release()


async def _revoke_found(
    manager: KeyManager,
    keys: Sequence[ParsedKey],
    checkers: dict[str, KeyManager],
    actor: str | None,
) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for parsed in keys:
        prefix = manager_prefix(parsed.prefix)
        checker = checkers.get(prefix)
        if checker is None:
            checker = KeyManager(manager.store, hasher=manager.hasher, prefix=prefix, cache=False)
            checkers[prefix] = checker
        try:
            await checker.verify(parsed.token, record_usage=False)
        except KeyRevoked:
            outcomes[parsed.token] = "already revoked"
            continue
        except InvalidAPIKey:
            if await manager.store.get(parsed.id) is None:
                outcomes[parsed.token] = "unknown id in this store"
            else:
                outcomes[parsed.token] = (
                    "not revoked: the secret does not match this store's key "
                    "(another store's key, or a different APIKEYS_PEPPER)"
                )
            continue
        except (KeyDisabled, KeyExpired):
            pass  # the secret is right: a leaked disabled or expired key is revoked too
        except AuthenticationError as exc:
            if isinstance(exc, StoreUnavailable):
                raise
            outcomes[parsed.token] = f"not revoked: {exc.code}"
            continue
        try:
            await manager.revoke(parsed.id, actor=actor, leaked=True)
        except KeyNotFound:
            outcomes[parsed.token] = "unknown id in this store"
            continue
        outcomes[parsed.token] = "revoked"
    return outcomes
