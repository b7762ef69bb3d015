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
        assert committed.read_text() == fresh.read_text(), f"{fresh.name} drifted from its .proto; run `make protos`"


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_every_field_is_documented(proto: Path):
    lines = proto.read_text().splitlines()
    undocumented = [
        line.strip() for i, line in enumerate(lines)
        if FIELD.match(line) and "//" not in line and not lines[i - 1].strip().startswith("//")
    ]
    assert not undocumented, f"fields without a comment (say unit and default): {undocumented}"
