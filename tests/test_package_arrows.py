"""Package arrows point one way: protos <- common <- client, scheduler_svc, executor_svc; and rooms stay small.

``client`` and ``executor_svc`` never import ``scheduler_svc``; ``scheduler_svc`` imports
neither of them; ``common`` imports none of the three; the scheduler's core speaks no gRPC.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("common", "client", "scheduler_svc", "executor_svc")
# What each package may import of the project's own packages (``nanoserve`` is the protos).
ALLOWED = {
    "common": {"nanoserve", "common"},
    "client": {"nanoserve", "common", "client"},
    "executor_svc": {"nanoserve", "common", "executor_svc"},
    "scheduler_svc": {"nanoserve", "common", "scheduler_svc"},
}
# The pure cores: plain Python objects in and out, no wire types (each service's codec translates at the edge).
CORE_MODULES = sorted(
    str(path.relative_to(ROOT))
    for room in ("scheduler_svc/core", "executor_svc/core", "executor_svc/sample")
    for path in (ROOT / room).glob("*.py")
    if path.name != "codec.py"
) + ["scheduler_svc/engine/engine.py", "scheduler_svc/engine/supervision.py", "scheduler_svc/engine/admission.py"]
WIRE_MODULES = ("grpc", "nanoserve")


def imported_top_levels(path: Path) -> set[str]:
    """Top-level package of every absolute import in ``path``, lazy imports inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def project_imports(path: Path) -> set[str]:
    return imported_top_levels(path) & {*PROJECT_PACKAGES, "nanoserve", "bench", "tests"}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_arrows_allow(package: str):
    wrong = {
        str(path.relative_to(ROOT)): sorted(project_imports(path) - ALLOWED[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: names for path, names in wrong.items() if names} == {}


@pytest.mark.parametrize("module", CORE_MODULES)
def test_cores_speak_no_wire_types(module: str):
    assert imported_top_levels(ROOT / module) & set(WIRE_MODULES) == set()


def test_the_arrow_check_sees_a_wrong_import(tmp_path: Path):
    """The check itself would catch a client module importing the scheduler, even lazily."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from scheduler_svc.engine.engine import Engine\n    return Engine\n")
    assert project_imports(bad) == {"scheduler_svc"}


def test_rooms_stay_small():
    """The engine loop is the thread, the inbox, the step and the drain (<= 250 lines); no source file over 400;
    no service keeps more than a few modules at its top level (the rest live in rooms)."""
    sources = [p for package in ("scheduler_svc", "executor_svc", "client", "common")
               for p in (ROOT / package).rglob("*") if p.suffix in (".py", ".c", ".h")]
    too_long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 400}
    assert too_long == {}
    assert len((ROOT / "scheduler_svc/engine/loop.py").read_text().splitlines()) <= 250
    for service in ("scheduler_svc", "executor_svc"):
        top_level = sorted(p.name for p in (ROOT / service).glob("*.py"))
        assert len(top_level) <= 4, top_level


def module_level_imports(path: Path, package: str) -> set[str]:
    """The project modules ``path`` imports when it is loaded: lazy imports inside functions and imports for type
    checking only do not count, since they cannot make a circle at import time."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == package}


def import_circles(package: str) -> list[list[str]]:
    """Every circle of module-level imports among ``package``'s modules (a package's ``__init__`` included)."""
    modules = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: module_level_imports(path, package) & modules.keys() - {name} for name, path in modules.items()}
    circles, state = [], {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circles.append(trail[trail.index(target):] + [target])
            elif target not in state:
                visit(target, [*trail, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return circles


@pytest.mark.parametrize("package", ["scheduler_svc", "executor_svc", "client", "common"])
def test_no_module_level_import_circle(package: str):
    assert import_circles(package) == []


def test_the_circle_check_sees_a_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Two modules importing each other at load time are found, whichever import form they use."""
    package = tmp_path / "circle_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circle_pkg.b import thing\n")
    (package / "b.py").write_text("from circle_pkg import a\nthing = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_circles("circle_pkg") == [["circle_pkg.a", "circle_pkg.b", "circle_pkg.a"]]
