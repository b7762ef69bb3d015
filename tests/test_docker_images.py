"""The images' Dockerfiles, read without a Docker engine: each copies (and lets through its build context's filter)
every package of the repository that the code it copies imports, so its programs start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.service_fixtures import ROOT

IMAGES = ["scheduler", "executor-cpu", "executor"]
IMPORT = re.compile(r"^\s*(?:from|import)\s+(\w+)", re.MULTILINE)
# The repository's importable top-level packages, by folder (the generated protos install as ``nanoserve``).
PACKAGES = {"protos": "nanoserve", **{p.name: p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}}


def copied(dockerfile: Path) -> set[str]:
    """The repository folders the Dockerfile copies into the image."""
    return {line.split()[1].rstrip("/") for line in dockerfile.read_text().splitlines()
            if line.startswith("COPY ") and (ROOT / line.split()[1]).is_dir()}


def let_through(dockerfile: Path) -> set[str]:
    """The folders its .dockerignore (which starts from ``*``) lets into the build context."""
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    assert ignore[next(i for i, line in enumerate(ignore) if not line.startswith("#"))] == "*"
    return {line[1:].rstrip("/") for line in ignore if line.startswith("!")}


def imported(folders: set[str]) -> set[str]:
    """The repository's packages that the Python files in ``folders`` import."""
    names = {name for folder in folders for path in (ROOT / folder).rglob("*.py")
             for name in IMPORT.findall(path.read_text())}
    return {folder for folder, package in PACKAGES.items() if package in names}


@pytest.mark.parametrize("image", IMAGES)
def test_an_image_holds_every_package_its_code_imports(image: str) -> None:
    dockerfile = ROOT / "docker" / f"{image}.Dockerfile"
    folders = copied(dockerfile)
    assert folders <= let_through(dockerfile), f"{image}: copied but filtered out of the build context"
    assert imported(folders) <= folders, f"{image}: imported but not copied: {sorted(imported(folders) - folders)}"
