"""Package arrows point one way: protos <- common <- client, scheduler_svc, executor_svc; and rooms stay small.

``client`` and ``executor_svc`` never import ``scheduler_svc``; ``scheduler_svc`` imports
neither of them; ``common`` imports none of the three; the scheduler's core speaks no gRPC.
"""

from __future__ import annotations

import ast
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
# The scheduler's pure core, its plans and its output processing: plain Python objects in and out, no wire types.
CORE_MODULES = ("scheduler_svc/scheduler.py", "scheduler_svc/block_manager.py", "scheduler_svc/sequence.py",
                "scheduler_svc/planner.py", "scheduler_svc/outputs.py", "scheduler_svc/validation.py",
                "scheduler_svc/supervision.py", "scheduler_svc/admission.py")
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
def test_scheduler_core_speaks_no_wire_types(module: str):
    assert imported_top_levels(ROOT / module) & set(WIRE_MODULES) == set()


def test_the_arrow_check_sees_a_wrong_import(tmp_path: Path):
    """The check itself would catch a client module importing the scheduler, even lazily."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from scheduler_svc.engine import Engine\n    return Engine\n")
    assert project_imports(bad) == {"scheduler_svc"}


def test_rooms_stay_small():
    """The engine loop is the thread, the inbox, the step and the drain (<= 250 lines); no source file over 400."""
    sources = [p for package in ("scheduler_svc", "executor_svc", "client", "common")
               for p in (ROOT / package).rglob("*") if p.suffix in (".py", ".c", ".h")]
    too_long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 400}
    assert too_long == {}
    assert len((ROOT / "scheduler_svc/loop.py").read_text().splitlines()) <= 250
