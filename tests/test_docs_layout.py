"""The README's Layout table and docs/architecture.md name every module of the package, each
under its own folder, and name no module that is gone.

Modules: every ``*.py`` in the package's source folders (each folder under ``cachefs/``,
``client/``, ``server/`` and ``proto/`` that holds an ``__init__.py``, so a new subpackage is
walked too), except ``__init__.py`` and the generated ``*_pb2*.py`` stubs. A module is known by
its path from the repository root, e.g. ``client/session.py``.

README.md, section "## Layout": a table row belongs to the folder named by the first backticked
``folder/`` in its first cell (rows of other folders, such as ``tests/``, are not checked). In a
row, a backticked bare name (```session.py```) names that module of the row's folder; a backticked
path (```server/worker/reader.py```) names that module wherever it stands in the section. So a
module listed only in another folder's row does not count. Every package folder needs one row.

docs/architecture.md: a path (``client/session.py``, backticked or not, in the diagram too) names
that module. A bare name (``sampling.py``) names the module of the folder mentioned last before it
in the same block (a paragraph, a list item, a line of a code block), by a module path
(``client/dataset.py``) or a folder (``server/master``, ``cachefs/store/``); a bare name with no
folder before it in its block fails, as it names nothing for sure.

Either way, a name that resolves to no module (removed, moved, misspelt) fails too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("cachefs", "client", "server", "proto")


def _folders() -> list[str]:
    out = []
    for top in ROOTS:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            if "__pycache__" not in init.parts:
                out.append(init.parent.relative_to(ROOT).as_posix())
    return sorted(out)


FOLDERS = _folders()


def _modules() -> set[str]:
    out = set()
    for folder in FOLDERS:
        for path in (ROOT / folder).glob("*.py"):
            if path.name == "__init__.py" or re.search(r"_pb2(_grpc)?\.py$", path.name):
                continue
            out.add(f"{folder}/{path.name}")
    return out


MODULES = _modules()

_TOP = "(?:" + "|".join(ROOTS) + ")"
# A module path (client/session.py), a folder (server/worker, cachefs/store/), or a bare name
# (session.py). Not inside another path (tests/test_x.py, deploy/helm/cachefs), not a dotted
# module name (cachefs.proto.generate), not a URL (cachefs://).
_TOKEN = re.compile(
    rf"(?<![\w/.\-])(?:(?P<path>{_TOP}(?:/\w+)*/\w+\.py)(?![\w/])"
    rf"|(?P<folder>{_TOP}(?:/\w+)+/?|{_TOP}/)(?![\w/])(?!\.\w)"
    rf"|(?P<bare>\w+\.py)(?![\w/]))")


def _resolve_blocks(blocks: list[str]) -> tuple[set[str], list[str]]:
    """Names found in ``blocks`` (module paths, resolved) and problems (bare names with no folder)."""
    named: set[str] = set()
    problems: list[str] = []
    for block in blocks:
        context: str | None = None
        for m in _TOKEN.finditer(block):
            if m["path"]:
                named.add(m["path"])
                context = m["path"].rsplit("/", 1)[0]
            elif m["folder"]:
                folder = m["folder"].rstrip("/")
                if folder in FOLDERS:
                    context = folder
            elif context is None:
                problems.append(f"{m['bare']} (no folder before it in: {block.strip()[:80]!r})")
            else:
                named.add(f"{context}/{m['bare']}")
    return named, problems


def _blocks(text: str) -> list[str]:
    """Paragraphs and list items of prose; each line of a fenced code block on its own."""
    blocks: list[str] = []
    current: list[str] = []
    fenced = False

    def flush() -> None:
        if current:
            blocks.append("\n".join(current))
            current.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            flush()
            fenced = not fenced
        elif fenced:
            blocks.append(line)
        elif not line.strip():
            flush()
        else:
            if re.match(r"\s*(?:[-*+]|\d+\.)\s|#", line):
                flush()
            current.append(line)
    flush()
    return blocks


def architecture_names(text: str) -> tuple[set[str], list[str]]:
    return _resolve_blocks(_blocks(text))


def layout_section(readme: str) -> str:
    m = re.search(r"^## Layout\s*$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert m, "README.md has no '## Layout' section"
    return m.group(1)


def readme_names(section: str) -> tuple[set[str], list[str]]:
    """Names in the Layout section and problems (package folders with no row, or two)."""
    named: set[str] = set()
    rows: dict[str, int] = {}
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = line.strip().strip("|").split("|")
        first = re.search(r"`([\w/]+/)`", cells[0])
        folder = first.group(1).rstrip("/") if first else None
        if folder in FOLDERS:
            rows[folder] = rows.get(folder, 0) + 1
        for tok in re.findall(r"`([\w/.]+\.py)`", line):
            if "/" not in tok:
                if folder in FOLDERS:
                    named.add(f"{folder}/{tok}")
            elif tok.split("/", 1)[0] in ROOTS:
                named.add(tok)
    # Paths outside the table (e.g. in the import rules) name modules too.
    for tok in re.findall(r"`([\w/.]+\.py)`", section):
        if "/" in tok and tok.split("/", 1)[0] in ROOTS:
            named.add(tok)
    problems = [f"no row for folder {f}/" for f in FOLDERS if f not in rows]
    problems += [f"{n} rows for folder {f}/" for f, n in rows.items() if n > 1]
    return named, problems


def _report(doc: str, named: set[str], problems: list[str]) -> list[str]:
    missing = sorted(MODULES - named)
    gone = sorted(named - MODULES)
    out = [f"{doc}: {p}" for p in problems]
    if missing:
        out.append(f"{doc} does not name (under its folder): {', '.join(missing)}")
    if gone:
        out.append(f"{doc} names modules that do not exist: {', '.join(gone)}")
    return out


def test_the_walk_finds_the_package():
    assert {"cachefs", "cachefs/store", "client", "server", "server/worker", "server/master",
            "server/pagestore", "proto", "client/transport", "client/datasets"} <= set(FOLDERS)
    assert "client/transport/session.py" in MODULES and "proto/generate.py" in MODULES
    assert not any(m.endswith("__init__.py") or "_pb2" in m for m in MODULES)


def test_readme_layout_names_every_module():
    named, problems = readme_names(layout_section((ROOT / "README.md").read_text()))
    report = _report("README.md Layout", named, problems)
    assert not report, "\n".join(report)


def test_architecture_names_every_module():
    named, problems = architecture_names((ROOT / "docs" / "architecture.md").read_text())
    report = _report("docs/architecture.md", named, problems)
    assert not report, "\n".join(report)


# -- the rules themselves --------------------------------------------------------------------------

def test_readme_rule_counts_a_name_only_in_its_folders_row():
    section = ("| folder | import | what |\n|---|---|---|\n"
               "| `client/` | `cachefs.client` | `session.py`, `reader.py` |\n"
               "| `server/worker/` | x | `service.py`, `server/master/jobs.py` |\n"
               "| `tests/` | | `helpers.py` |\n")
    named, problems = readme_names(section)
    assert named == {"client/session.py", "client/reader.py", "server/worker/service.py", "server/master/jobs.py"}
    assert "client/reader.py" not in MODULES  # listed under the wrong folder: named, but as a module that is not there
    assert "no row for folder server/master/" in problems and "no row for folder client/" not in problems


@pytest.mark.parametrize("text, named, problems", [
    ("`client/dataset.py`, `sampling.py` and `server/master/stat.py` (`placement.py`)",
     {"client/dataset.py", "client/sampling.py", "server/master/stat.py", "server/master/placement.py"}, 0),
    ("The master (`server/master`): `jobs.py`.\n\nThen `loader.py` alone.", {"server/master/jobs.py"}, 1),
    ("- `server/pagestore/store.py`\n- `health.py`", {"server/pagestore/store.py"}, 1),
    ("```\nworker (server/worker)  reader.py\nclient/view.py  tests/test_client.py\n```",
     {"server/worker/reader.py", "client/view.py"}, 0),
    ("`python -m cachefs.proto.generate`, cachefs://m/k, deploy/helm/cachefs, proto/worker.proto", set(), 0),
])
def test_architecture_rule_resolves_bare_names_by_the_folder_before_them(text, named, problems):
    got, found = architecture_names(text)
    assert got == named and len(found) == problems, (got, found)
