"""The contract: committed stubs match the .proto files, and every field is documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
PROTOS = sorted((PROTO_DIR / "nanoserve" / "v1").glob("*.proto"))
FIELD = re.compile(r"^\s*(optional |repeated )?[\w.]+ \w+ = \d+;")


# The lines naming the versions of the generator that wrote a stub (grpcio-tools and its protobuf, the latter
# twice: in the header and as the runtime check's arguments): the oldest grpcio and protobuf the stub imports with,
# not part of the contract.
GRPC_VERSION = re.compile(r"GRPC_GENERATED_VERSION = '([\d.]+)'")
PROTOBUF_VERSION = re.compile(r"# Protobuf Python Version: ([\d.]+)")
PROTOBUF_RUNTIME_CHECK = re.compile(r"Domain\.PUBLIC,\s*\d+,\s*\d+,\s*\d+,")


def without_generator_versions(stub: str) -> str:
    for pattern in (GRPC_VERSION, PROTOBUF_VERSION, PROTOBUF_RUNTIME_CHECK):
        stub = pattern.sub("<generator version>", stub)
    return stub


def release(version: str) -> tuple[int, ...]:
    return tuple(map(int, version.split(".")))


def minimum(requirement: str) -> tuple[int, ...]:
    """The lowest version of ``requirement`` that pyproject.toml's dependencies allow."""
    found = re.search(rf'"{re.escape(requirement)}>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert found, f"pyproject.toml names no minimum version of {requirement}"
    return release(found.group(1))


def test_generated_stubs_match_the_proto_files(tmp_path: Path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, PROTOS)],
        check=True,
    )
    generated = sorted((tmp_path / "nanoserve" / "v1").glob("*_pb2*"))
    assert generated, "protoc produced nothing"
    for fresh in generated:
        committed = PROTO_DIR / "nanoserve" / "v1" / fresh.name
        assert committed.exists(), f"{fresh.name} is not committed; run `make protos`"
        assert without_generator_versions(committed.read_text()) == without_generator_versions(fresh.read_text()), \
            f"{fresh.name} drifted from its .proto; run `make protos`"


def test_the_committed_stubs_import_with_the_oldest_grpcio_and_protobuf_pyproject_allows():
    """A stub refuses a grpcio or protobuf older than the generator that wrote it, so the dependencies' minimums
    must be at least those versions."""
    for stub in sorted((PROTO_DIR / "nanoserve" / "v1").glob("*_pb2*.py")):
        text = stub.read_text()
        for pattern, requirement in ((GRPC_VERSION, "grpcio"), (PROTOBUF_VERSION, "protobuf")):
            for found in pattern.finditer(text):
                assert release(found.group(1)) <= minimum(requirement), (stub.name, requirement)


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_every_field_is_documented(proto: Path):
    lines = proto.read_text().splitlines()
    undocumented = [
        line.strip() for i, line in enumerate(lines)
        if FIELD.match(line) and "//" not in line and not lines[i - 1].strip().startswith("//")
    ]
    assert not undocumented, f"fields without a comment (say unit and default): {undocumented}"
