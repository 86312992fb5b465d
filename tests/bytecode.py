"""Compiled bytecode for the Python processes the suite starts, when the interpreter writes none.

Many tests start Python processes of their own (the `apikeys` command line, uvicorn
workers, writers in other hosts, pytest itself), and each imports apikeys, the tests' helpers
and the examples. With `PYTHONDONTWRITEBYTECODE` set (as in many containers and CI images) nothing
ever writes their bytecode, so every one of those processes compiles some 80,000 lines of
source again before it does anything: about a tenth of a second of CPU each. `compiled()`
compiles them once for the session and removes, at its end, the `__pycache__` folders it made
(Python checks each file against its source, so an edit during the session is still seen).
"""

from __future__ import annotations

import compileall
import contextlib
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["compiled"]


def _caches(folders: Iterable[Path]) -> set[Path]:
    return {cache for folder in folders for cache in folder.rglob("__pycache__")}


@contextlib.contextmanager
def compiled(folders: Iterable[Path]) -> Iterator[None]:
    """The modules under `folders` have their bytecode while this runs (only compiled when the
    interpreter writes none itself); the `__pycache__` folders it made are removed after."""
    folders = [folder for folder in folders if folder.is_dir()]
    if not sys.dont_write_bytecode:
        yield
        return
    before = _caches(folders)
    try:
        for folder in folders:
            compileall.compile_dir(folder, quiet=2, workers=1)
        yield
    finally:
        for cache in _caches(folders) - before:
            shutil.rmtree(cache, ignore_errors=True)
