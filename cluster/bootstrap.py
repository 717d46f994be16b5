"""Starting and stopping a Tandem cluster on Ray: a local Ray when RAY_ADDRESS is unset (with the
pools' custom resources declared, so actors place the way they would on KubeRay), or join the
cluster RAY_ADDRESS names; then the controller actor, which starts the pools."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from tandem.cluster.config import ClusterConfig
from tandem.cluster.controller import Controller
from tandem.cluster.reaper import start_reaper
from tandem.engine.parallel.sharding import check_shardable
from tandem.engine.weights import load_tokenizer, resolve_model_dir
from tandem.kv_transfer.reshard import check_reshardable

log = logging.getLogger(__name__)


@dataclass
class Cluster:
    controller: Any
    namespace: str
    started_ray: bool

    def shutdown(self) -> None:
        try:
            ray.get(self.controller.shutdown.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 - shutting down anyway
            log.warning("controller shutdown: %s", e)
        try:
            ray.kill(self.controller)
        except Exception:  # noqa: BLE001
            pass
        if self.started_ray:
            ray.shutdown()


def init_ray(config: ClusterConfig, namespace: str) -> bool:
    """Connect to RAY_ADDRESS, or start a local Ray sized for the configured pools. Returns True
    when this process started Ray (and so must stop it)."""
    if ray.is_initialized():
        return False
    env = {"env_vars": {k: v for k, v in os.environ.items()
                        if k.startswith(("TANDEM_", "NCCL_", "TORCH_", "TRITON_", "OMP_")) or k == "PYTHONPATH"}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace=namespace, runtime_env=env, log_to_driver=False)
        return False
    pools = [config.prefill, config.decode]
    cpus = max(os.cpu_count() or 1, int(sum(p.num_cpus * max(p.replicas, 1) for p in pools)) + 1)
    resources = {p.resource_name: 64 for p in pools if p.resource_name}
    ray.init(num_cpus=cpus, resources=resources, namespace=namespace, include_dashboard=False,
             object_store_memory=256 << 20, log_to_driver=False, runtime_env=env,
             _system_config={"automatic_object_spilling_enabled": False})
    start_reaper()   # a SIGKILL of this process must not leave Ray's agents behind
    return True


def check_tensor_parallel(config: ClusterConfig) -> None:
    """Refuse, before anything starts, a pool whose ranks cannot split the model, and pools whose
    KV cannot be resharded by whole heads between them (KV moves between any two workers: a
    remote prefill, a prefix pull, a sequence moved with its KV, a worker in another role)."""
    model_cfg = load_tokenizer(config.engine.model)[1]
    sizes = {p: config.engine_for(p).tensor_parallel_size for p in ("prefill", "decode")}
    for pool, tp in sizes.items():
        check_shardable(model_cfg, tp, config.engine.model)
    check_reshardable(model_cfg.num_kv_heads, sizes["prefill"], sizes["decode"])


def start_cluster(config: ClusterConfig, namespace: str | None = None, wait_s: float = 600.0) -> Cluster:
    resolve_model_dir(config.engine.model)  # convert a GGUF once, here, before actors race to it
    check_tensor_parallel(config)
    namespace = namespace or f"tandem-{uuid.uuid4().hex[:6]}"
    started = init_ray(config, namespace)
    controller = Controller.options(name=f"{namespace}:controller", namespace=namespace).remote(config, namespace)
    cluster = Cluster(controller, namespace, started)
    try:
        ray.get(controller.wait_ready.remote(wait_s))
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
