"""Generate chunkwise/v1/*_pb2*.py from proto/chunkwise/v1/*.proto with grpcio-tools.

The generated files are committed (so installing chunkwise needs no code generation step);
tests/test_proto_current.py regenerates into a temp dir and fails if the committed copy is stale.
Run: python scripts/gen_proto.py [OUT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # imported here: grpcio-tools is a dev/test dependency only

    sources = sorted((PROTO_DIR / "chunkwise" / "v1").glob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(s) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out_dir / "chunkwise" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path.relative_to(out))
