"""deploy/: the KubeRay manifests and the Helm chart (rendered by deploy/render.py with default and
non-default values) are valid against the KubeRay CRDs and Kubernetes' own schemas, agree with
cluster/config.py (the ConfigMap loads, worker groups advertise the pools' resources), and pin one
Ray version everywhere. No cluster and no network: the schemas ship with kubernetes-validate."""

from __future__ import annotations

import tempfile

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tandem.cluster.config import ClusterConfig, config_to_dict, load_config
from deploy.render import TemplateError, render_chart, render_manifests, render_template

try:  # Kubernetes' JSON schemas, shipped in the package: no network needed
    import kubernetes_validate
except ImportError:  # pragma: no cover - the test extra installs it
    kubernetes_validate = None

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
CHART = ROOT / "deploy" / "helm" / "tandem"


def _crd_dir() -> Path:
    """shared/kuberay/crds beside the checkout (the session's and CI's layout), or beside the
    repository this one was cloned from (a throwaway clone made elsewhere, e.g. under /tmp)."""
    here = ROOT.parent / "shared" / "kuberay" / "crds"
    if here.is_dir():
        return here
    try:
        origin = subprocess.run(["git", "-C", str(ROOT), "remote", "get-url", "origin"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return here
    if origin and Path(origin).is_dir():
        beside = Path(origin).resolve().parent / "shared" / "kuberay" / "crds"
        if beside.is_dir():
            return beside
    return here


CRD_DIR = _crd_dir()
K8S_VERSION = "1.30"  # oldest Kubernetes the manifests target (native gRPC probes are GA from 1.27)
RAY_KINDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml",
             "RayJob": "ray.io_rayjobs.yaml"}
FILE_KINDS = {"ray-cluster": "RayCluster", "ray-service": "RayService", "ray-job": "RayJob",
              "configmap": "ConfigMap", "secret": "Secret", "service": "Service",
              "deployment": "Deployment", "pvc": "PersistentVolumeClaim", "pod": "Pod",
              "pdb": "PodDisruptionBudget"}
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")

CUSTOM_VALUES = {
    "fullnameOverride": "coder",
    "image": {"repository": "registry.example.com/ml/tandem", "tag": "0.2.0-ray2.60.0-gpu", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "cluster": {"color": "green"},
    "model": {"name": "/models/Qwen2.5-Coder-32B-Instruct"},
    "models": {"source": "hostPath", "hostPath": "/mnt/models"},
    "engine": {"scheduler": {"max_num_seqs": 128}},
    "head": {"nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]},
    "prefill": {"replicas": 2, "minReplicas": 2, "maxReplicas": 16, "gpus": 2, "resourceName": "coder_prefill",
                "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}},
    "decode": {"gpus": 2, "resourceName": "coder_decode", "localPrefillThreshold": "inf"},
    "router": {"readinessService": "", "service": {"type": "LoadBalancer", "annotations": {"networking.gke.io/load-balancer-type": "Internal"}}},
    "autoscaler": {"enabled": False},
    "auth": {"existingSecret": "coder-token"},
    "redis": {"internal": {"enabled": False}, "externalUrl": "redis://redis.shared.svc:6379/3"},
}
VARIANTS = {
    "default": {},
    "cpu": yaml.safe_load((CHART / "values-cpu.yaml").read_text()),
    "custom": CUSTOM_VALUES,
    "no-auth": {"auth": {"enabled": False, "token": "unused"}, "models": {"pvc": {"existingClaim": "weights"}},
                "autoscaler": {"enabled": True, "upscaleDelaySeconds": 5}},
    "router-tls": {"routerTLS": {"enabled": True, "secretName": "router-certs", "requireClientCert": True,
                                 "serverName": "tandem.example.internal"}},
    "ray-tls": {"rayTLS": {"enabled": True, "secretName": "ray-certs"}, "rayAuth": {"mode": "token", "secretName": "ray-token"},
                "prefill": {"podDisruptionBudget": {"enabled": False}, "drainDeadlineSeconds": 45},
                "router": {"drainTimeoutSeconds": 200, "preStopDelaySeconds": 0}, "lifecycle": {"terminationMarginSeconds": 10},
                "auth": {"token": "t" * 40, "adminToken": "a" * 40}},
}


# ------------------------------------------------------------------------------------------------
# Schemas

def _to_json_schema(node):
    """A CRD's structural OpenAPI v3 schema as JSON Schema that rejects unknown fields (as kubectl's
    default strict field validation does) and checks list-map keys are unique."""
    if isinstance(node, list):
        return [_to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in ("description", "default", "format", "x-kubernetes-validations", "x-kubernetes-map-type",
                 "x-kubernetes-int-or-string", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
                 "x-kubernetes-preserve-unknown-fields", "nullable"):
            continue
        out[k] = _to_json_schema(v) if k in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not") \
            else ({p: _to_json_schema(s) for p, s in v.items()} if k == "properties" else v)
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-list-type") == "map":
        out["x-unique-keys"] = node.get("x-kubernetes-list-map-keys", [])
    elif node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def _unique_keys(validator, keys, instance, schema):
    seen = set()
    for item in instance if isinstance(instance, list) else []:
        key = tuple(json.dumps(item.get(k)) for k in keys)
        if key in seen:
            yield jsonschema.ValidationError(f"duplicate entry for keys {keys}: {key}")
        seen.add(key)


CRDValidator = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-unique-keys": _unique_keys})


@pytest.fixture(scope="module")
def crd_validators():
    if not CRD_DIR.is_dir():
        # the CRDs live in the workspace's shared/ folder (CI has it beside the clone); a clone
        # elsewhere cannot check the ray.io schemas, only the core Kubernetes ones
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR}")
    validators = {}
    for kind, fname in RAY_KINDS.items():
        crd = yaml.load((CRD_DIR / fname).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        validators[kind] = CRDValidator(_to_json_schema(version["schema"]["openAPIV3Schema"]))
    return validators


def _k8s_validate(doc: dict, where: str) -> None:
    if kubernetes_validate is None:
        pytest.fail("kubernetes-validate is not installed; `make setup` installs it", pytrace=False)
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{where}: {'.'.join(map(str, e.path))}: {e.message}") from None


def _validate(doc: dict, crd_validators) -> None:
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    assert DNS_1035.match(doc["metadata"]["name"]), f"{where}: name is not a DNS-1035 label"
    if doc["kind"] not in RAY_KINDS:
        _k8s_validate(doc, where)
        return
    assert doc["apiVersion"] == "ray.io/v1", where
    errors = sorted(crd_validators[doc["kind"]].iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, f"{where}: " + "; ".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5])
    # The CRD leaves metadata open: check it, and each pod template, against Kubernetes' schemas.
    _k8s_validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}, f"{where} metadata")
    for name, tpl in _pod_templates(doc):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **tpl.get("metadata", {})},
               "spec": tpl["spec"]}
        _k8s_validate(pod, f"{where} {name} pod template")


# ------------------------------------------------------------------------------------------------
# Helpers

def _pod_templates(cluster: dict):
    spec = cluster["spec"]
    yield "head", spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]


def _raw_docs() -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(KUBERAY.glob("*.yaml"))}


def _find(docs: list[dict], kind: str, name: str) -> dict | None:
    return next((d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name), None)


def _load_config_text(text: str, tmp_path: Path) -> ClusterConfig:
    """load_config on a ConfigMap's config.yaml. An `autoscaler:` section is set aside while
    cluster/config.py does not know it yet (the chart writes it only when asked)."""
    data = yaml.safe_load(text)
    if "autoscaler" in data and "autoscaler" not in config_to_dict(ClusterConfig()):
        data.pop("autoscaler")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def _head(cluster: dict) -> dict:
    return cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _cluster_config(cluster: dict, docs: list[dict], tmp_path: Path) -> ClusterConfig:
    volumes = cluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    (cm_name,) = [v["configMap"]["name"] for v in volumes if "configMap" in v]
    cm = _find(docs, "ConfigMap", cm_name)
    assert cm is not None, f"RayCluster {cluster['metadata']['name']} mounts missing ConfigMap {cm_name}"
    return _load_config_text(cm["data"]["config.yaml"], tmp_path)


def _ray_resources(group: dict) -> dict:
    raw = group["rayStartParams"]["resources"]
    return json.loads(raw.strip("'\"` ").replace('\\"', '"'))


def _check_cluster_consistency(docs: list[dict], tmp_path: Path, optional_refs: set[str] = frozenset()) -> None:
    """Every RayCluster in `docs` agrees with its ConfigMap and finds what it references."""
    clusters = [d for d in docs if d["kind"] == "RayCluster"]
    assert clusters
    for cluster in clusters:
        where = cluster["metadata"]["name"]
        cfg = _cluster_config(cluster, docs, tmp_path)
        spec = cluster["spec"]
        assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", where
        assert spec["enableInTreeAutoscaling"] is True, where
        assert {"upscalingMode", "idleTimeoutSeconds", "resources"} <= set(spec["autoscalerOptions"]), where
        groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
        assert set(groups) == {"prefill", "decode"}, where
        for name, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            g = groups[name]
            assert _ray_resources(g) == {pool.resource_name: 1}, f"{where}/{name}: resources vs config"
            assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], f"{where}/{name}"
            limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
            gpus = float(limits.get("nvidia.com/gpu", 0))
            assert gpus == pool.num_gpus, f"{where}/{name}: pod GPUs {gpus} != actor num_gpus {pool.num_gpus}"
            assert (cfg.engine.device == "cuda") == (gpus > 0), f"{where}/{name}: device vs GPUs"
        head = _head(cluster)
        ports = {p["name"]: p["containerPort"] for p in head["ports"]}
        assert ports["grpc"] == cfg.router.port and cfg.router.host == "0.0.0.0", where
        # the kubelet's gRPC probes speak plaintext: the router's port, or its health port under TLS
        tls = "--tls-cert-file" in head["args"][0]
        probed = cfg.router.health_port if tls else cfg.router.port
        assert probed is not None and (not tls or ports["grpc-health"] == probed), where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert head[probe]["grpc"]["port"] == probed, f"{where}: {probe}"
        assert "--config /etc/tandem/config.yaml" in head["args"][0], where
        assert "--block" in head["args"][0] and "exec tandem up" in head["args"][0], where
        mounts = {m["mountPath"] for m in head["volumeMounts"]}
        assert "/etc/tandem" in mounts, where
        assert (cfg.engine.model.startswith("/models/")) == ("/models" in mounts), f"{where}: model path vs mount"
        # References: Secrets, claims and ConfigMaps exist unless they are expected from outside.
        for env in (e for _, tpl in _pod_templates(cluster) for c in tpl["spec"]["containers"] for e in c.get("env", [])):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref and not ref.get("optional") and ref["name"] not in optional_refs:
                secret = _find(docs, "Secret", ref["name"])
                assert secret, f"{where}: Secret {ref['name']} missing"
                assert ref["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}, f"{where}: {ref}"
        for _, tpl in _pod_templates(cluster):
            for v in tpl["spec"].get("volumes", []):
                claim = v.get("persistentVolumeClaim", {}).get("claimName")
                if claim and claim not in optional_refs:
                    assert _find(docs, "PersistentVolumeClaim", claim), f"{where}: PVC {claim} missing"
        redis = cfg.router.redis_url
        if redis and redis.startswith("redis://") and "." not in redis.split("//")[1].split(":")[0]:
            host = redis.split("//")[1].split(":")[0]
            assert _find(docs, "Service", host), f"{where}: Redis Service {host} missing"
    for svc in (d for d in docs if d["kind"] == "Service" and "ray.io/node-type" in d["spec"]["selector"]):
        selector = svc["spec"]["selector"]
        heads = [c for c in clusters
                 if selector.items() <= {**c["spec"]["headGroupSpec"]["template"]["metadata"]["labels"],
                                         "ray.io/node-type": "head"}.items()]
        assert heads, f"Service {svc['metadata']['name']} selects no head"
        for p in svc["spec"]["ports"]:
            for c in heads:
                assert p["targetPort"] in {q["name"] for q in _head(c)["ports"]}, f"{svc['metadata']['name']}: {p}"


# ------------------------------------------------------------------------------------------------
# Raw manifests

def test_manifest_files_are_named_after_their_kind():
    docs = _raw_docs()
    assert docs
    for fname, file_docs in docs.items():
        kind, feature, ext = fname.split(".")
        assert kind in FILE_KINDS and feature and ext == "yaml", fname
        assert [d["kind"] for d in file_docs] == [FILE_KINDS[kind]], fname


@pytest.mark.parametrize("fname", sorted(p.name for p in KUBERAY.glob("*.yaml")))
def test_manifest_validates(fname, crd_validators):
    for doc in _raw_docs()[fname]:
        _validate(doc, crd_validators)


def test_manifests_agree_with_config(tmp_path):
    docs = [d for file_docs in _raw_docs().values() for d in file_docs]
    _check_cluster_consistency(docs, tmp_path)


# ------------------------------------------------------------------------------------------------
# Helm chart

@pytest.fixture(scope="module", params=sorted(VARIANTS))
def rendered(request):
    return request.param, render_manifests(CHART, VARIANTS[request.param])


def test_chart_validates(rendered, crd_validators):
    _, docs = rendered
    assert len({(d["kind"], d["metadata"]["name"]) for d in docs}) == len(docs), "duplicate objects"
    for doc in docs:
        _validate(doc, crd_validators)


def test_chart_agrees_with_config(rendered, tmp_path):
    variant, docs = rendered
    values = VARIANTS[variant]
    outside = {values.get("auth", {}).get("existingSecret"), values.get("models", {}).get("pvc", {}).get("existingClaim")}
    _check_cluster_consistency(docs, tmp_path, optional_refs=outside - {None, ""})


def test_chart_values_reach_the_objects(tmp_path):
    docs = render_manifests(CHART, CUSTOM_VALUES)
    kinds = sorted(d["kind"] for d in docs)
    # no Secret, PVC or Redis: all external
    assert kinds == ["ConfigMap", "PodDisruptionBudget", "PodDisruptionBudget", "PodDisruptionBudget", "RayCluster",
                     "Service"]
    cluster = _find(docs, "RayCluster", "coder-green")
    head = _head(cluster)
    assert head["image"] == "registry.example.com/ml/tandem:0.2.0-ray2.60.0-gpu"
    assert "--autoscale" not in head["args"][0]
    assert "service" not in head["readinessProbe"]["grpc"]
    token = [e for e in head["env"] if e["name"] == "TANDEM_AUTH_TOKEN"][0]
    assert token["valueFrom"]["secretKeyRef"]["name"] == "coder-token"
    prefill = cluster["spec"]["workerGroupSpecs"][0]
    assert prefill["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert prefill["template"]["spec"]["volumes"][0]["hostPath"]["path"] == "/mnt/models"
    cfg = _cluster_config(cluster, docs, tmp_path)
    assert cfg.router.redis_url == "redis://redis.shared.svc:6379/3"
    assert cfg.decode.local_prefill_threshold == float("inf")
    assert cfg.engine.scheduler.max_num_seqs == 128
    assert _find(docs, "Service", "coder")["spec"]["type"] == "LoadBalancer"


def test_chart_auth_and_redis_defaults(tmp_path):
    docs = render_manifests(CHART, {})
    secret = _find(docs, "Secret", "tandem-auth")
    assert len(secret["data"]["token"]) >= 48  # random, base64
    cfg = _cluster_config(_find(docs, "RayCluster", "tandem-blue"), docs, tmp_path)
    assert cfg.router.redis_url == "redis://tandem-redis:6379/0"
    off = render_manifests(CHART, VARIANTS["no-auth"])
    assert not [d for d in off if d["kind"] == "Secret"]
    assert "TANDEM_AUTH_TOKEN" not in {e["name"] for e in _head(_find(off, "RayCluster", "tandem-blue"))["env"]}
    notes = render_chart(CHART, {})["tandem/templates/NOTES.txt"]
    assert "port-forward" in notes and "tandem-auth" in notes


def test_chart_autoscaler_section_reaches_the_config():
    from tandem.cluster.config import load_config

    def config(values):
        docs = render_manifests(CHART, values)
        return yaml.safe_load([d for d in docs if d["kind"] == "ConfigMap"][0]["data"]["config.yaml"])
    section = config({})["autoscaler"]
    assert section["enabled"] is True and section["ttft_target_s"] == 1.0 and section["decode_max"] == 8
    off = config({"autoscaler": {"enabled": False}})
    assert off["autoscaler"]["enabled"] is False
    assert section["max_workers"] is None
    assert config({"autoscaler": {"maxWorkers": 4}})["autoscaler"]["max_workers"] == 4
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(config({"autoscaler": {"upscaleDelaySeconds": 7}}), f)
        f.flush()
        cfg = load_config(f.name)
    assert cfg.autoscale and cfg.autoscaler.upscale_delay_s == 7 and cfg.autoscaler.decode_max == 8
    # the KV transport's direct copy is on unless the chart turns it off; the workers get the section
    assert config({})["kv_transfer"] == {"direct_copy": True}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(config({"kvTransfer": {"directCopy": False}}), f)
        f.flush()
        cfg = load_config(f.name)
    assert cfg.kv_transfer.direct_copy is False and cfg.kv_transfer.start_timeout_s == 600.0


def _values_keys_without_doc(path: Path) -> list[str]:
    """Keys of a values file without a `# --` comment in the comment block right above them. A
    documented key documents its whole value (a map or list below it); undocumented parent keys only
    group, and their children need their own comment."""
    missing, comment, covered_below = [], [], None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if not stripped or stripped.startswith("#"):
            comment = comment + [stripped] if stripped else []
            continue
        if covered_below is not None and (indent > covered_below or stripped.startswith("- ")):
            continue
        covered_below = None
        documented = any(c.startswith("# --") for c in comment)
        comment = []
        if documented:
            covered_below = indent
        elif not stripped.endswith(":"):
            missing.append(stripped.split(":", 1)[0])
    return missing


@pytest.mark.parametrize("fname", ["values.yaml", "values-cpu.yaml"])
def test_values_are_documented(fname):
    assert _values_keys_without_doc(CHART / fname) == []


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "tandem"
    assert re.match(r"^\d+\.\d+\.\d+$", chart["version"])


# ------------------------------------------------------------------------------------------------
# One Ray version everywhere

def test_ray_version_pinned_together():
    pyproject = (ROOT / "pyproject.toml").read_text()
    (ray,) = re.findall(r'"ray\[default\]==([\d.]+)"', pyproject)
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (ROOT / "deploy" / name).read_text()
        assert re.search(rf"^ARG RAY_VERSION={re.escape(ray)}$", text, re.M), name
        assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-py311-", text, re.M), name
    clusters = [d for ds in _raw_docs().values() for d in ds if d["kind"] == "RayCluster"]
    clusters += [d for v in VARIANTS.values() for d in render_manifests(CHART, v) if d["kind"] == "RayCluster"]
    for c in clusters:
        assert c["spec"]["rayVersion"] == ray, c["metadata"]["name"]
        for _, tpl in _pod_templates(c):
            image = tpl["spec"]["containers"][0]["image"]
            assert f"-ray{ray}-" in image, f"{c['metadata']['name']}: {image} does not carry Ray {ray}"


def test_dockerfiles_explain_every_instruction():
    for name in ("Dockerfile", "Dockerfile.cpu"):
        lines = (ROOT / "deploy" / name).read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"^(FROM|RUN|COPY|ARG|WORKDIR|ENV)\b", line):
                above = lines[max(0, i - 6):i]
                assert any(a.startswith("#") for a in above), f"{name}:{i + 1}: {line!r} has no comment"
    cpu = (ROOT / "deploy" / "Dockerfile.cpu").read_text()
    assert '"torch==${TORCH_VERSION}"' in cpu and "ARG TORCH_VERSION=2.13.0" in cpu
    assert "download.pytorch.org/whl/cpu" in cpu


# ------------------------------------------------------------------------------------------------
# The template renderer itself

def test_renderer_matches_go_template_semantics():
    _run = render_template
    assert _run("a  {{- 1 -}}  b", {}) == "a1b"
    assert _run("{{ .Values.n }} {{ .Values.f }}", {"n": 1000000, "f": 0.5}) == "1e+06 0.5"
    assert _run('{{ if .Values.x }}y{{ else if eq .Values.s "a" }}a{{ else }}n{{ end }}', {"x": 0, "s": "a"}) == "a"
    assert _run("{{ range $k, $v := .Values.m }}{{ $k }}={{ $v }};{{ end }}", {"m": {"b": 2, "a": "x"}}) == "a=x;b=2;"
    assert _run("{{ range .Values.l }}[{{ . }}]{{ else }}none{{ end }}", {"l": []}) == "none"
    assert _run("k:{{- toYaml .Values.m | nindent 2 }}", {"m": {"a": [1]}}) == "k:\n  a:\n  - 1"
    assert _run('{{ include "x" .Values.m }}', {"m": {"a": "b"}}, defines='{{ define "x" }}<{{ .a }}>{{ end }}') == "<b>"
    assert _run('{{ (dict "a" 1).a }} {{ printf "%s-%s" "x" "y" | quote }}', {}) == '1 "x-y"'
    with pytest.raises(TemplateError, match="incompatible types"):
        _run("{{ eq .Values.n 1 }}", {"n": 1})
    with pytest.raises(TemplateError, match="not in this subset"):
        _run("{{ sha256sum .Values.s }}", {"s": "x"})
    with pytest.raises(TemplateError, match="nil pointer"):
        _run("{{ .Values.a.b }}", {})
