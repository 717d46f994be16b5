"""Regenerate the checked-in Python stubs of protos/tandem/v1/*.proto.

    python protos/generate.py            # in place, next to the .proto files
    python protos/generate.py --out DIR  # into DIR/protos/tandem/v1/ (the drift test uses this)

The repository root is the include path, so generated modules import each other as
`from protos.tandem.v1 import ...`, while the proto package stays `tandem.v1` (the gRPC service
names are `tandem.v1.Generation` and `tandem.v1.Admin`).

The stubs are then relaxed so they load on every runtime that pyproject.toml allows: protoc pins
the protobuf runtime to at least its own version (`ValidateProtobufRuntimeVersion`) and the gRPC
plugin pins grpcio to at least the grpcio-tools version. The generated code uses nothing newer than
protobuf 5.27 / grpcio 1.66 (checked by loading and calling it under those versions), so the
protobuf pin is removed and the grpcio pin lowered to the floor below.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata, resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = REPO_ROOT / "protos" / "tandem" / "v1"
GRPC_FLOOR = "1.66.0"  # pyproject.toml: grpcio>=1.66

_PROTOBUF_PIN = re.compile(
    r"from google\.protobuf import runtime_version as _runtime_version\n"
    r"|_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:[^\n]*\n)*?\)\n")
_GRPC_PIN = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M)
_MODULE_PATH = re.compile(r"(from |')protos\.(?=tandem\.v1)")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def relax_version_pins(path: Path) -> None:
    text = path.read_text()
    if path.name.endswith("_pb2.py"):
        text = _PROTOBUF_PIN.sub("", text)
    elif path.name.endswith("_pb2_grpc.py"):
        text = _GRPC_PIN.sub(f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", text)
    # protoc names modules by their path under the repository; they install under `tandem.`.
    text = _MODULE_PATH.sub(r"\1tandem.protos.", text)
    # The stamp goes after protoc's "DO NOT EDIT" line (the top of a .pyi, which has none).
    tools = metadata.version("grpcio-tools")
    stamp = f"# Post-processed by protos/generate.py (grpcio-tools {tools})\n"
    lines = text.splitlines(keepends=True)
    at = next((i + 1 for i, line in enumerate(lines[:3]) if "DO NOT EDIT" in line), 0)
    path.write_text("".join(lines[:at]) + stamp + "".join(lines[at:]))


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Run protoc on every .proto; returns the generated files (under out_dir/protos/tandem/v1)."""
    from grpc_tools import protoc  # noqa: PLC0415 (a test/dev dependency only)

    out_dir = Path(out_dir).resolve()
    well_known = resources.files("grpc_tools") / "_proto"
    args = ["grpc_tools.protoc", f"-I{REPO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(p) for p in proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    target = out_dir / PROTO_DIR.relative_to(REPO_ROOT)
    generated = []
    for proto in proto_files():
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = target / f"{proto.stem}{suffix}"
            relax_version_pins(path)
            generated.append(path)
    return generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT,
                        help="root to write protos/tandem/v1/*_pb2*.py under (default: in place)")
    for path in generate(parser.parse_args(argv).out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
