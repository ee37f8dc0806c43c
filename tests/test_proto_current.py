"""The committed generated code in chunkwise/v1 must match what the .proto files generate."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("grpc_tools", reason="grpcio-tools is part of the test extra")


def test_generated_code_is_current(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen_proto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_proto)
    fresh = gen_proto.generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is not committed; run: python scripts/gen_proto.py"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{rel} is stale; run: python scripts/gen_proto.py"
        )
    committed_names = {p.name for p in (ROOT / "chunkwise" / "v1").glob("*_pb2*.py*")}
    assert committed_names == {p.name for p in fresh}, "stray generated files in chunkwise/v1"
