"""Lay the repository's folders out as the packages Tandem installs as (tandem.engine -> engine/, ...)
under DEST, as symlinks, for a machine where Tandem is not pip-installed (the GPU device's image).

    python3 bench/layout.py ~/layout && export PYTHONPATH=~/layout:$PYTHONPATH
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def link_layout(dest: Path) -> None:
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = dest / "tandem"
    root.mkdir(parents=True, exist_ok=True)
    for path in (REPO / package_dirs["tandem"]).iterdir():  # the root package's own files and folders
        link = root / path.name
        if not link.exists() and path.name != "__pycache__":
            link.symlink_to(path)
    for package, folder in package_dirs.items():
        if package != "tandem":
            link = dest.joinpath(*package.split("."))
            if not link.exists():
                link.symlink_to(REPO / folder, target_is_directory=True)


if __name__ == "__main__":
    link_layout(Path(sys.argv[1]).expanduser())
