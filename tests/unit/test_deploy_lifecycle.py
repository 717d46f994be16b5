"""Kubernetes lifecycle of the manifests and the chart (issue 27): preStop hooks that drain (pool
pods: `tandem drain-worker --self`, parsed by the real CLI; the head: a delay, then SIGTERM drains
the router), terminationGracePeriodSeconds that cover them, a PodDisruptionBudget per group, Ray's
auth and TLS options, the router's TLS (probes on its plaintext health port), values.schema.json,
and the chart rendered and linted by real Helm (installed by `make setup`: deploy/install_helm.py),
whose output render.py must match."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from deploy.install_helm import DEFAULT_DEST as HELM
from deploy.render import render_manifests
from tandem.cluster import commands, lifecycle
from tests.unit.test_deploy import CHART, VARIANTS, _cluster_config, _find, _head, _pod_templates, _raw_docs

MARGIN_S = 10  # the least time a pod's grace period must leave after its drain


def _merged(*layers: dict) -> dict:
    out: dict = {}
    for layer in layers:
        for k, v in layer.items():
            out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _clusters():
    """(name, docs, RayCluster) of every raw manifest set and chart variant."""
    raw = [d for ds in _raw_docs().values() for d in ds]
    for c in (d for d in raw if d["kind"] == "RayCluster"):
        yield f"raw:{c['metadata']['name']}", raw, c
    for variant, values in sorted(VARIANTS.items()):
        docs = render_manifests(CHART, values)
        for c in (d for d in docs if d["kind"] == "RayCluster"):
            yield f"chart:{variant}", docs, c


CLUSTERS = list(_clusters())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def _parse_cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    return parser.parse_args(argv)


def _hook_argv(container: dict, env: dict[str, str]) -> list[str]:
    """The preStop command as bash would run it (`bash -c "exec tandem ..."`), env expanded."""
    cmd = container["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[:2] == ["/bin/bash", "-c"], cmd
    script = cmd[2]
    assert script.startswith("exec tandem "), script
    out = subprocess.run(["bash", "-c", f"printf '%s\\n' {script.removeprefix('exec ')}"],
                         env={**env, "PATH": os.environ["PATH"]}, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _env_names(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("where,docs,cluster", CLUSTERS, ids=[c[0] for c in CLUSTERS])
def test_pool_pods_drain_before_they_stop(where, docs, cluster, tmp_path):
    cfg = _cluster_config(cluster, docs, tmp_path)
    head_env = _env_names(cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0])
    for group in cluster["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        # KubeRay sets FQ_RAY_IP in worker pods; the fallback names the same Service
        for fq in ("tandem-x-head-svc.ns.svc.cluster.local", None):
            argv = _hook_argv(container, {"FQ_RAY_IP": fq} if fq else {})
            args = _parse_cli(argv[1:])
            assert argv[0] == "tandem" and args.func is lifecycle.cmd_drain_worker, argv
            assert args.self_host and not args.workers
            host, port = args.target.rsplit(":", 1)
            assert int(port) == cfg.router.port, f"{where}/{group['groupName']}: {args.target}"
            assert host == (fq or f"{cluster['metadata']['name']}-head-svc"), args.target
        assert spec["terminationGracePeriodSeconds"] >= args.deadline + MARGIN_S, \
            f"{where}/{group['groupName']}: grace {spec['terminationGracePeriodSeconds']} vs deadline {args.deadline}"
        # the Admin API takes only the admin token: the hook gets the head's
        env = _env_names(container)
        if "TANDEM_AUTH_TOKEN" in head_env:
            assert env["TANDEM_ADMIN_TOKEN"] == head_env["TANDEM_ADMIN_TOKEN"], where
            assert env["TANDEM_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "admin-token"
        else:
            assert "TANDEM_ADMIN_TOKEN" not in env, where


@pytest.mark.parametrize("where,docs,cluster", CLUSTERS, ids=[c[0] for c in CLUSTERS])
def test_head_grace_covers_the_routers_drain(where, docs, cluster, tmp_path):
    cfg = _cluster_config(cluster, docs, tmp_path)
    spec = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    pre_stop = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep", pre_stop
    delay = float(pre_stop[1])
    assert spec["terminationGracePeriodSeconds"] >= delay + cfg.router.drain_timeout_s + MARGIN_S, where


def _selects(pdb: dict, labels: dict) -> bool:
    return pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("where,docs,cluster", CLUSTERS, ids=[c[0] for c in CLUSTERS])
def test_one_disruption_budget_per_group(where, docs, cluster):
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    name = cluster["metadata"]["name"]
    if where == "raw:tandem-cpu":  # the laptop sample: one node, no drains, no budgets
        disabled = {"prefill", "decode", "head"}
    else:
        values = _merged(DEFAULTS, VARIANTS[where[6:]]) if where.startswith("chart:") else DEFAULTS
        disabled = {g for g in ("prefill", "decode", "head") if not values[g]["podDisruptionBudget"]["enabled"]}
    for group, tpl in _pod_templates(cluster):
        # KubeRay adds ray.io/cluster to every pod it makes
        labels = {**tpl["metadata"]["labels"], "ray.io/cluster": name}
        mine = [p for p in pdbs if _selects(p, labels)]
        if group in disabled:
            assert not mine, f"{where}/{group}"
            continue
        assert len(mine) == 1, f"{where}/{group}: {len(mine)} budgets"
        assert mine[0]["spec"]["maxUnavailable"] == (0 if group == "head" else 1), f"{where}/{group}"
        others = [t for g, t in _pod_templates(cluster) if g != group]
        assert not any(_selects(mine[0], {**t["metadata"]["labels"], "ray.io/cluster": name}) for t in others)


def test_ray_auth_and_tls_options():
    gpu = _find(_raw_docs()["ray-cluster.tandem-gpu.yaml"], "RayCluster", "tandem")
    assert gpu["spec"]["authOptions"] == {"mode": "token"}
    default = _find(render_manifests(CHART, {}), "RayCluster", "tandem-blue")
    assert default["spec"]["authOptions"] == {"mode": "token"}
    off = _find(render_manifests(CHART, {"rayAuth": {"mode": "disabled"}}), "RayCluster", "tandem-blue")
    assert "authOptions" not in off["spec"]
    tls = _find(render_manifests(CHART, VARIANTS["ray-tls"]), "RayCluster", "tandem-blue")
    assert tls["spec"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    for group, tpl in _pod_templates(tls):
        (c,) = tpl["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["RAY_USE_TLS"] == "1", group
        mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["ray-tls"]
        for var, f in (("RAY_TLS_SERVER_CERT", "tls.crt"), ("RAY_TLS_SERVER_KEY", "tls.key"), ("RAY_TLS_CA_CERT", "ca.crt")):
            assert env[var] == f"{mount}/{f}", group
        vol = {v["name"]: v for v in tpl["spec"]["volumes"]}["ray-tls"]
        assert vol["secret"]["secretName"] == "ray-certs", group


def test_ray_reads_the_variables_the_chart_sets():
    """The names are Ray's own (the installed version): RAY_AUTH_MODE in its token-auth setup,
    RAY_USE_TLS and RAY_TLS_* in its TLS loader."""
    from ray._common import tls_utils
    from ray._private.authentication import authentication_token_setup

    assert authentication_token_setup.AUTH_MODE_ENV_VAR == "RAY_AUTH_MODE"
    source = Path(tls_utils.__file__).read_text()
    for var in ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
        assert f'"{var}"' in source, var


# ------------------------------------------------------------------------------------------------
# values.schema.json

@pytest.fixture(scope="module")
def schema():
    s = yaml.safe_load((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(s)
    return jsonschema.Draft7Validator(s)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_values_follow_the_schema(schema, variant):
    errors = list(schema.iter_errors(_merged(DEFAULTS, VARIANTS[variant])))
    assert not errors, [e.message for e in errors]


@pytest.mark.parametrize("bad", [
    {"prefill": {"gpus": "one"}}, {"decode": {"drainDeadlineSeconds": 0}}, {"rayAuth": {"mode": "password"}},
    {"rayTLS": {"enabled": True}}, {"prefill": {"podDisruptionBudget": {"maxUnavailable": "half"}}},
    {"router": {"drainTimeoutSeconds": -1}}, {"routr": {}}, {"image": {"pullPolicy": "Sometimes"}},
])
def test_schema_refuses_bad_values(schema, bad):
    assert list(schema.iter_errors(_merged(DEFAULTS, bad)))


# ------------------------------------------------------------------------------------------------
# Real Helm

def _helm(*args: str) -> subprocess.CompletedProcess:
    if not HELM.is_file():
        pytest.fail(f"{HELM} missing: `make setup` installs it (deploy/install_helm.py)", pytrace=False)
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def _without_random(docs: list[dict]) -> dict:
    out = {}
    for d in docs:
        if d["kind"] == "Secret":  # randAlphaNum differs between renders
            d = {**d, "data": sorted(d.get("data", {}))}
        out[(d["kind"], d["metadata"]["name"])] = d
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_template_matches_render_py(variant, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VARIANTS[variant]))
    out = _helm("template", "tandem", str(CHART), "-f", str(values))
    assert out.returncode == 0, out.stderr
    helm_docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert _without_random(helm_docs) == _without_random(render_manifests(CHART, VARIANTS[variant]))


@pytest.mark.parametrize("extra", [[], ["-f", str(CHART / "values-cpu.yaml")]], ids=["default", "cpu"])
def test_helm_lint(extra):
    out = _helm("lint", "--strict", str(CHART), *extra)
    assert out.returncode == 0, out.stdout + out.stderr


def test_helm_enforces_the_schema():
    out = _helm("template", "tandem", str(CHART), "--set", "decode.podDisruptionBudget.maxUnavailable=half")
    assert out.returncode != 0 and "maxUnavailable" in out.stderr
    out = _helm("template", "tandem", str(CHART), "--set", "rayTLS.enabled=true")
    assert out.returncode != 0 and "secretName" in out.stderr


def test_chart_router_tls_reaches_the_router_the_probes_and_the_prestop_drain(tmp_path):
    """routerTLS: the head's `tandem up` serves TLS (mutual, here) from the mounted Secret, its probes
    ask the plaintext health port (the kubelet's gRPC probes cannot speak TLS) that the config opens,
    and the pool pods' preStop drain connects with the CA, a client certificate and the server name."""
    docs = render_manifests(CHART, VARIANTS["router-tls"])
    cluster = _find(docs, "RayCluster", "tandem-blue")
    head = _head(cluster)
    args = head["args"][0]
    up = _parse_cli(args.split("exec tandem ", 1)[1].split())          # the real CLI takes them
    assert (up.tls_cert_file, up.tls_key_file, up.tls_client_ca_file, up.tls_require_client_cert) == \
        ("/etc/tandem-tls/tls.crt", "/etc/tandem-tls/tls.key", "/etc/tandem-tls/ca.crt", True)
    assert {p["name"]: p["containerPort"] for p in head["ports"]}["grpc-health"] == 50052
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert head[probe]["grpc"]["port"] == 50052, probe
    assert _cluster_config(cluster, docs, tmp_path).router.health_port == 50052
    for spec in [cluster["spec"]["headGroupSpec"]["template"]["spec"]] + \
            [g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]:
        assert {"name": "router-tls", "secret": {"secretName": "router-certs"}} in spec["volumes"]
        assert any(m["name"] == "router-tls" and m["mountPath"] == "/etc/tandem-tls"
                   for m in spec["containers"][0]["volumeMounts"])
    for group in cluster["spec"]["workerGroupSpecs"]:
        drain = group["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert drain.endswith("--tls-ca-file /etc/tandem-tls/ca.crt --tls-cert-file /etc/tandem-tls/tls.crt "
                              "--tls-key-file /etc/tandem-tls/tls.key --tls-server-name tandem.example.internal")
    plain = render_manifests(CHART, {})
    head = _head(_find(plain, "RayCluster", "tandem-blue"))
    assert "--tls" not in head["args"][0] and head["livenessProbe"]["grpc"]["port"] == 50051
    assert "grpc-health" not in {p["name"] for p in head["ports"]}
    with pytest.raises(Exception, match="routerTLS"):
        render_manifests(CHART, {"routerTLS": {"enabled": True}})
