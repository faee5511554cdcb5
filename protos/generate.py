"""Generate Python protobuf and gRPC stubs from the .proto files beside this script.

Used by the package build (setup.py) and runnable by hand:
    python protos/generate.py [OUT_DIR]        # default OUT_DIR: the repository root
Each protos/gpuloom/v1/X.proto becomes OUT_DIR/gpuloom/v1/X_pb2.py, X_pb2.pyi and X_pb2_grpc.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def generate_stubs(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) over every .proto file; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_ROOT}")
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {[p.name for p in protos]}")
    generated = []
    for proto in protos:
        stem = proto.relative_to(PROTO_ROOT).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            generated.append(out_dir / f"{stem}{suffix}")
    return generated


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent
    for path in generate_stubs(target):
        print(path)
