"""Size limits of STYLE.md, enforced by `make lint`: no module over 500 lines, no function over 60.

Generated protobuf stubs and Triton kernel files (modules under engine/kernels/ whose functions
are @triton.jit kernels) are excepted from the module limit. Run: python .ci/check_sizes.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
ROOTS = ("tandem", "engine", "kv_transfer", "prefill_workers", "decode_workers", "router", "cluster",
         "protos", "bench", "deploy", "tests", ".ci")


def _is_triton_kernel_file(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        for dec in getattr(node, "decorator_list", ()):
            if "triton" in ast.unparse(dec) and "jit" in ast.unparse(dec):
                return True
    return False


def violations(repo: Path) -> list[str]:
    out = []
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            text = path.read_text()
            tree = ast.parse(text)
            rel = path.relative_to(repo)
            lines = text.count("\n")
            if lines > MAX_MODULE_LINES and not _is_triton_kernel_file(tree):
                out.append(f"{rel}: {lines} lines (limit {MAX_MODULE_LINES}): split it")
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        out.append(f"{rel}:{node.lineno}: {node.name} is {n} lines "
                                   f"(limit {MAX_FUNCTION_LINES})")
    return out


def main() -> int:
    found = violations(Path(__file__).resolve().parents[1])
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
