"""The shape of `src/apikeys`: no module above 800 lines, no function above
cyclomatic complexity 20 (radon's figure), and no private name imported across packages.

A package is a module's folder. Helpers shared inside a folder are public there (STYLE.md), so
a private name is imported neither from another folder nor from another module of the same
one; a private module (`_name.py`) may be imported inside its own folder only.

An exception would be listed with its figure, which may not grow; an entry that no longer
offends fails the test until it is removed. The lists are empty.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from radon.complexity import cc_visit
from radon.visitors import Class, Function

import apikeys

SRC = Path(apikeys.__file__).parent
MAX_LINES = 800
MAX_COMPLEXITY = 20

# Exceptions to the rules, each with its figure, which may only shrink: none today.
LONG_MODULES: dict[str, int] = {}
COMPLEX_FUNCTIONS: dict[str, int] = {}
PRIVATE_IMPORTS: frozenset[str] = frozenset()


def _modules(root: Path = SRC) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _relative(path: Path, root: Path = SRC) -> str:
    return path.relative_to(root).as_posix()


def _complexities(
    blocks: Iterable[Function | Class], prefix: str = ""
) -> Iterator[tuple[str, int]]:
    """Every function, method and closure in `blocks`, by qualified name, with its figure."""
    for block in blocks:
        name = f"{prefix}.{block.name}" if prefix else block.name
        if isinstance(block, Function):
            yield name, block.complexity
            yield from _complexities(block.closures, name)
        else:
            yield from _complexities([*block.methods, *block.inner_classes], name)


def complexities(source: str) -> dict[str, int]:
    """Radon's cyclomatic complexity of each function in `source`, by qualified name."""
    # cc_visit lists methods both on their own and in their class: start from the top level.
    top = [b for b in cc_visit(source) if isinstance(b, Class) or not b.is_method]
    return dict(_complexities(top))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(source: str, path: str, exists: set[str]) -> list[str]:
    """Each private name that the module at `path` (relative to src, e.g. `apikeys/cli/x.py`)
    imports from another module, as `importer -> module:name`, or `importer -> module` for a
    private module imported from outside its folder. `exists` holds the modules' paths."""
    parts = path.removesuffix(".py").split("/")
    package = parts[:-1]  # the folder, for `__init__.py` too
    found: list[str] = []

    def module_path(dotted: list[str]) -> str:
        name = "/".join(dotted)
        return f"{name}/__init__.py" if f"{name}/__init__.py" in exists else f"{name}.py"

    def note(target: list[str], name: str | None) -> None:
        target_path = module_path(target)
        if target_path == path:
            return
        if name is not None:
            if f"{module_path([*target, name])}" in exists:  # a submodule: a module import
                note([*target, name], None)
                return
            if _is_private(name):
                found.append(f"{path} -> {target_path}:{name}")
            return
        target_folder = target[:-1] if not target_path.endswith("__init__.py") else target
        private_module = any(_is_private(part) for part in target)
        if private_module and target_folder != package:
            found.append(f"{path} -> {target_path}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "apikeys":
                    note(alias.name.split("."), None)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = [*base, *(node.module.split(".") if node.module else [])]
            if target and target[0] == "apikeys":
                for alias in node.names:
                    note(target, alias.name)
    return found


def _report(title: str, offenders: dict[str, int], known: dict[str, int], limit: int) -> list[str]:
    problems = [
        f"{name}: {figure} (limit {limit})"
        for name, figure in sorted(offenders.items())
        if name not in known
    ]
    problems += [
        f"{name}: grew from {known[name]} to {figure}"
        for name, figure in sorted(offenders.items())
        if name in known and figure > known[name]
    ]
    problems += [
        f"{name}: within the limit now (or gone): remove it from the list"
        for name in sorted(set(known) - set(offenders))
    ]
    return [f"{title}: {problem}" for problem in problems]


def test_no_module_is_longer_than_800_lines() -> None:
    lengths = {_relative(path): len(path.read_text().splitlines()) for path in _modules()}
    offenders = {name: lines for name, lines in lengths.items() if lines > MAX_LINES}
    problems = _report("lines", offenders, LONG_MODULES, MAX_LINES)
    assert not problems, "\n".join(problems)


def test_no_function_is_more_complex_than_20() -> None:
    offenders: dict[str, int] = {}
    for path in _modules():
        for name, figure in complexities(path.read_text()).items():
            if figure > MAX_COMPLEXITY:
                offenders[f"{_relative(path)}:{name}"] = figure
    problems = _report("complexity", offenders, COMPLEX_FUNCTIONS, MAX_COMPLEXITY)
    assert not problems, "\n".join(problems)


def _all_private_imports() -> set[str]:
    root = SRC.parent
    exists = {_relative(path, root) for path in _modules()}
    found: set[str] = set()
    for path in _modules():
        found.update(private_imports(path.read_text(), _relative(path, root), exists))
    return {item.replace("apikeys/", "") for item in found}


def _folder(path: str) -> str:
    return path.rpartition("/")[0]


def test_no_module_imports_a_private_name_from_another_package() -> None:
    found = _all_private_imports()
    across = sorted(
        item
        for item in found
        if _folder(item.split(" -> ")[0]) != _folder(item.split(" -> ")[1].partition(":")[0])
    )
    assert not across, "\n".join(across)


def test_no_module_imports_a_private_name_from_another_module() -> None:
    found = _all_private_imports()
    problems = [f"{item}: make it public there" for item in sorted(found - PRIVATE_IMPORTS)]
    problems += [
        f"{item}: gone: remove it from the list" for item in sorted(PRIVATE_IMPORTS - found)
    ]
    assert not problems, "\n".join(problems)


# -- the checks themselves -------------------------------------------------------------------

_TREE = {
    "apikeys/__init__.py",
    "apikeys/a.py",
    "apikeys/pkg/__init__.py",
    "apikeys/pkg/common.py",
    "apikeys/pkg/_impl.py",
    "apikeys/pkg/sub/__init__.py",
    "apikeys/pkg/sub/x.py",
}


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        ("apikeys/pkg/x.py", "from apikeys.pkg.common import run, main", []),
        (
            "apikeys/pkg/x.py",
            "from apikeys.pkg.common import _run",
            ["apikeys/pkg/x.py -> apikeys/pkg/common.py:_run"],
        ),
        (
            "apikeys/pkg/sub/x.py",
            "from .. import common, _impl\nfrom ..common import _table",
            [
                "apikeys/pkg/sub/x.py -> apikeys/pkg/_impl.py",
                "apikeys/pkg/sub/x.py -> apikeys/pkg/common.py:_table",
            ],
        ),
        ("apikeys/pkg/common.py", "from apikeys.pkg import _impl", []),
        ("apikeys/pkg/common.py", "from apikeys.pkg._impl import Thing", []),
        ("apikeys/a.py", "import apikeys.pkg._impl", ["apikeys/a.py -> apikeys/pkg/_impl.py"]),
        (
            "apikeys/pkg/sub/__init__.py",
            "from apikeys.pkg.sub.x import _y\nfrom apikeys.pkg import _z",
            [
                "apikeys/pkg/sub/__init__.py -> apikeys/pkg/sub/x.py:_y",
                "apikeys/pkg/sub/__init__.py -> apikeys/pkg/__init__.py:_z",
            ],
        ),
        ("apikeys/a.py", "from os import _exit\nfrom apikeys import __version__", []),
    ],
)
def test_private_imports_are_found(path: str, source: str, expected: list[str]) -> None:
    assert sorted(private_imports(source, path, _TREE)) == sorted(expected)


def test_complexity_counts_methods_closures_and_nested_classes_once() -> None:
    source = (
        "class A:\n"
        "    def m(self, x):\n"
        "        def inner(y):\n"
        "            return 1 if y else 2\n"
        "        return inner(x) if x else 0\n"
        "    class B:\n"
        "        def n(self, a, b):\n"
        "            return a and b\n"
        "def f(a):\n"
        "    for item in a:\n"
        "        if item:\n"
        "            return item\n"
    )
    assert complexities(source) == {"A.m": 2, "A.m.inner": 2, "A.B.n": 2, "f": 3}
