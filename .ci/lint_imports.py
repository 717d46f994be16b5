"""Check the import-linter contracts of pyproject.toml on the layout Tandem installs as.

The repository keeps a folder per layer (engine/, router/, ...) that installs as tandem.<folder>
(pyproject's package-dir); import-linter reads packages from disk, so this copies the Python files
into that layout in a temporary directory and runs `lint-imports` there.
Run: python .ci/lint_imports.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_layout(dest: Path) -> None:
    setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in setuptools_cfg["package-dir"].items():
        target = dest.joinpath(*package.split("."))
        shutil.copytree(REPO / folder, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tandem-layout-") as tmp:
        build_layout(Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        lint = Path(sys.executable).with_name("lint-imports")
        return subprocess.call([str(lint), str(REPO / "pyproject.toml"), "--no-cache"],
                               cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main())
