"""Generates the Python gRPC modules in ``ecrec/wire`` from ``proto/``.

The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` files are checked in, so a user
needs no code generator at install time; ``tests/test_proto.py`` regenerates
them into a temporary folder and fails when the checked-in copies are stale.

    python -m ecrec.protogen            # rewrite ecrec/wire/*_pb2*.py
    python -m ecrec.protogen --check    # exit 1 when they are stale
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
WIRE_DIR = Path(__file__).resolve().parent / "wire"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "ecrec" / "wire").glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) on every proto; returns the generated files."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - dev dependency
        raise RuntimeError("grpcio-tools is needed to generate code: pip install -e '.[dev]'") from exc
    import grpc_tools

    protos = proto_files()
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_ROOT}")
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
    ] + [str(p.relative_to(PROTO_ROOT)) for p in protos]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return sorted((out_root / "ecrec" / "wire").glob("*_pb2*.py*"))


def stale_files() -> list[str]:
    """Names of generated files that differ from (or are missing in) ecrec/wire."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            current = WIRE_DIR / path.name
            if not current.exists() or not filecmp.cmp(path, current, shallow=False):
                stale.append(path.name)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the checked-in code is current")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated code (run python -m ecrec.protogen): " + ", ".join(stale), file=sys.stderr)
            return 1
        print("generated code is current")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (WIRE_DIR / path.name).write_bytes(path.read_bytes())
            print(f"wrote ecrec/wire/{path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
