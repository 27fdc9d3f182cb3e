"""Which module may import which: checked in fresh interpreters (what a module really loads) and
by reading the sources (imports inside functions too, and cycles among module-level imports).

The rules (README, Layout): the client and ``cachefs.auth`` never load a daemon module; the
config, errors and paths modules load neither grpc nor fsspec (a CLI parsing flags, or a process
that only reads a config, pays for neither); the shared core (``cachefs.store``,
``cachefs.pagefile``) is what both sides import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each part of the cachefs namespace lives in the repository (pyproject's package-dir).
FOLDERS = {"cachefs": ROOT / "cachefs", "cachefs.server": ROOT / "server", "cachefs.client": ROOT / "client",
           "cachefs.proto": ROOT / "proto"}


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if "__pycache__" in parts:
                continue
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()
CLIENT_MODULES = sorted(m for m in MODULES if m.startswith("cachefs.client."))


def _loaded(module: str) -> list[str]:
    """The modules a fresh interpreter holds after importing ``module``."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    wanted = ["cachefs.config", "cachefs.errors", "cachefs.paths", "cachefs.auth", "cachefs.store.objects",
              "cachefs.pagefile", *CLIENT_MODULES]
    with ThreadPoolExecutor(2) as pool:  # two cores, shared
        return dict(zip(wanted, pool.map(_loaded, wanted)))


@pytest.mark.parametrize("module", ["cachefs.config", "cachefs.errors", "cachefs.paths"])
def test_light_modules_load_neither_grpc_nor_fsspec(loaded, module):
    heavy = [m for m in loaded[module] if m.split(".")[0] in ("grpc", "fsspec")]
    assert module in loaded[module] and not heavy, heavy[:5]


@pytest.mark.parametrize("module", ["cachefs.auth", "cachefs.store.objects", "cachefs.pagefile", *CLIENT_MODULES])
def test_no_client_or_shared_module_loads_a_daemon_module(loaded, module):
    daemon = [m for m in loaded[module] if m == "cachefs.server" or m.startswith("cachefs.server.")]
    assert module in loaded[module] and not daemon, daemon


def _imports(tree: ast.AST, *, module_level_only: bool) -> list[tuple[str, int]]:
    """Absolute imports (name, line); ``module_level_only`` skips function bodies and
    ``if TYPE_CHECKING:`` blocks (what runs when the module is imported)."""
    out: list[tuple[str, int]] = []

    def add(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub if sub in MODULES else node.module, node.lineno))

    if not module_level_only:
        for node in ast.walk(tree):
            add(node)
        return out

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                test = node.test
                if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                    visit(node.orelse)
                    continue
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(part)
            elif isinstance(node, ast.With):
                visit(node.body)
            else:
                add(node)

    visit(tree.body)  # type: ignore[attr-defined]
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        names = _imports(ast.parse(path.read_text(), str(path)), module_level_only=True)
        graph[module] = {name for name, _ in names if name in MODULES and name != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_module_level_imports():
    graph = _graph()
    assert graph["cachefs.store.objects"] >= {"cachefs.store.metatable", "cachefs.store.meta"}  # it sees edges
    assert _cycles(graph) == []


@pytest.mark.parametrize("path", sorted([*(ROOT / "client").rglob("*.py"), *(ROOT / "cachefs" / "store").rglob("*.py"),
                                         ROOT / "cachefs" / "auth.py", ROOT / "cachefs" / "pagefile.py",
                                         ROOT / "cachefs" / "errors.py", ROOT / "cachefs" / "tls.py"]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_client_and_shared_sources_never_import_a_daemon_module_even_lazily(path):
    names = _imports(ast.parse(path.read_text(), str(path)), module_level_only=False)
    daemon = [f"{name} (line {line})" for name, line in names if name == "cachefs.server" or name.startswith("cachefs.server.")]
    assert not daemon


def test_the_fsspec_entry_point_still_resolves():
    code = ("from importlib.metadata import entry_points; "
            "ep = [e for e in entry_points(group='fsspec.specs') if e.name == 'cachefs'][0]; "
            "cls = ep.load(); import fsspec; assert fsspec.get_filesystem_class('cachefs') is cls; print(ep.value)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cachefs.client.fs.filesystem:CacheFileSystem"


def test_every_package_is_in_pyprojects_packages_list():
    """A package missing there is left out of the wheel (the editable install here would not notice)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    assert packages == listed, (packages - listed, listed - packages)


def _asks_for_the_pid(source: str) -> list[int]:
    """Lines of ``source`` that ask the OS which process this is (``os.getpid``, however imported)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "getpid":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name == "getpid" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_the_finder_of_pid_checks_finds_them():
    assert _asks_for_the_pid("import os\nx = os.getpid()\n") == [2]
    assert _asks_for_the_pid("from os import getpid\n") == [1]
    assert _asks_for_the_pid("from cachefs.client import forksafe\nx = forksafe.pid()\n") == []


def test_only_forksafe_asks_which_process_the_client_is_in():
    """Fork safety in one place (#45): the client's per-process state is forksafe's ProcessLocal,
    or compares ``forksafe.pid()``; no other client module asks the OS for its pid."""
    found = {name: lines for name, path in MODULES.items() if name.startswith("cachefs.client")
             and name != "cachefs.client.forksafe" and (lines := _asks_for_the_pid(path.read_text()))}
    assert not found, found


#: The client's rooms in layer order: a module imports (at module level or lazily) only from its own
#: room and the ones before it (README, Layout), so the read path is found from the top down.
CLIENT_ROOMS = ["timeouts", "forksafe", "transport", "stats", "fs", "datasets", "fuse"]


def _room(module: str) -> str:
    return module.split(".")[2]


def test_each_client_room_imports_only_from_the_rooms_before_it():
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("cachefs.client.") or module.count(".") < 2:
            continue
        rank = CLIENT_ROOMS.index(_room(module))
        for name, line in _imports(ast.parse(path.read_text(), str(path)), module_level_only=False):
            if name.startswith("cachefs.client.") and CLIENT_ROOMS.index(_room(name)) > rank:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_every_client_room_is_a_known_room():
    rooms = {_room(m) for m in MODULES if m.startswith("cachefs.client.")}
    assert rooms == set(CLIENT_ROOMS), rooms


#: The only client modules that load gRPC when imported: what a process uses when it calls gRPC.
GRPC_CLIENT_MODULES = {"cachefs.client.transport.grpcchannels", "cachefs.client.transport.view"}


@pytest.mark.parametrize("module", [m for m in CLIENT_MODULES if m not in GRPC_CLIENT_MODULES])
def test_importing_a_client_module_loads_no_grpc(loaded, module):
    """A training process never loads gRPC (client/transport/masterport.py): importing any module it
    uses must not either."""
    assert module in loaded[module]
    assert not [m for m in loaded[module] if m == "grpc" or m.startswith("grpc.")], module
