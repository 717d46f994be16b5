"""Cluster configuration: one YAML file, flags override; each component gets only its own part.

    model: {name: smollm2-135m, dtype: float32, device: cpu, warmup: null}   # warmup: null = on CUDA
    cache: {block_size: 16, num_blocks: null, ...}       # engine.config.CacheConfig
    scheduler: {max_num_seqs: 256, ...}                  # engine.config.SchedulerConfig
    speculative: {method: off, num_tokens: 5, ...}       # engine.config.SpeculativeConfig (decode actors)
    prefill: {replicas: 1, resource_name: tandem_prefill, num_gpus: 0, max_queued_tokens: .inf}
    decode:  {replicas: 1, resource_name: tandem_decode, num_gpus: 0, local_prefill_threshold: 256}
    router:  {host: 127.0.0.1, port: 50051, redis_url: null, session_ttl_s: 3600, ...}
    autoscaler: {enabled: false, prefill_min: 1, prefill_max: 8, ttft_target_s: 2.0, ...}  # cluster.autoscaler

`load_config(path, overrides)` merges the file over the defaults, then dotted overrides
(`{"prefill.replicas": 2}`) over that, and validates everything on construction.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tandem.cluster.roles import RoleConfig
from tandem.cluster.autoscaler import AutoscalerConfig
from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.wire.errors import ConfigError
from tandem.kv_transfer.config import KVTransferConfig


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = 1
    # The Ray custom resource every actor of this pool asks for (0.001 of it, so many fit a node when
    # a node offers 1). On KubeRay each worker group advertises its pool's resource, so pending
    # actors make Ray's autoscaler add pods to the right group. Empty: ask for no custom resource.
    resource_name: str = ""
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    # decode pool only: prompts whose uncached part is at most this many tokens are prefilled by the
    # decode actor itself; math.inf is the colocated mode.
    local_prefill_threshold: float = 256
    # prefill pool only: a prefill actor that holds this many prompt tokens of a router's remote
    # prefills (queued, computing or sending) gets no more from that router; the decode actor prefills
    # the request itself instead. A backlogged prefill pool costs a request more TTFT than a local
    # prefill costs the decode batch in TPOT (conditional disaggregation). inf: always remote.
    max_queued_tokens: float = math.inf
    # the role its workers start in: "prefill" | "decode" | "mixed" (both); "": the pool's name.
    # The adaptive layout starts decode workers "mixed" and the role policy lends some to prefill.
    role: str = ""
    # ranks per worker of this pool, one process each (engine.parallel); None: the model section's
    tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size is not None and (not isinstance(self.tensor_parallel_size, int)
                                                      or self.tensor_parallel_size < 1):
            raise ConfigError(f"pool: tensor_parallel_size must be an integer >= 1 or null, got "
                              f"{self.tensor_parallel_size!r}")
        if self.role not in ("", "prefill", "decode", "mixed"):
            raise ConfigError(f"pool: role must be prefill, decode or mixed, got {self.role!r}")
        if self.replicas < 0:
            raise ConfigError(f"pool: replicas must be >= 0, got {self.replicas}")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ConfigError("pool: num_gpus and num_cpus must be >= 0")
        if self.local_prefill_threshold < 0:
            raise ConfigError("pool: local_prefill_threshold must be >= 0")
        if not self.max_queued_tokens > 0:
            raise ConfigError(f"pool: max_queued_tokens must be > 0 (inf: no limit), got {self.max_queued_tokens}")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = 8000  # the OpenAI-compatible HTTP API (router/openai_api.py); None: off
    # a plaintext port serving only grpc.health.v1 (the same statuses as `port`), for probes that
    # cannot speak TLS (the kubelet's gRPC probes) when `port` is TLS; None: off
    health_port: int | None = None
    redis_url: str | None = None
    session_ttl_s: float = 3600.0
    max_prompt_tokens: int | None = None  # None: the model's context
    max_request_bytes: int = 4 << 20
    # bounded admission: past max_in_flight requests queue; past max_queue, RESOURCE_EXHAUSTED
    max_in_flight: int = 256
    max_queue: int = 1024
    max_streams_per_client: int = 0  # 0: no per-client limit
    # refuse a request (RESOURCE_EXHAUSTED, retry-after-ms) when the requests ahead of it would take
    # longer than this to get their first token at the recent rate (router/admission.py); null: never
    max_expected_wait_s: float | None = 15.0
    # on SIGTERM the router stops admitting and lets its streams finish for up to this long, then
    # cancels the rest (router/drain.py); Kubernetes' terminationGracePeriodSeconds must exceed it
    drain_timeout_s: float = 90.0
    metrics_port: int | None = 8080  # Prometheus /metrics; None: off
    metrics_host: str = "127.0.0.1"
    metrics_auth: bool = False  # /metrics only with an admin token (Authorization: Bearer)
    # a request whose first token takes longer is logged with where the time went (None: never)
    slow_ttft_log_s: float | None = 1.0
    # a worker past any of these is overloaded: a session leaves it, and when every worker of a
    # pool is, requests get RESOURCE_EXHAUSTED (tandem.placement.OverloadLimits; None: not checked)
    worker_max_waiting: int | None = None
    worker_max_load: int | None = None
    worker_max_kv_usage: float | None = None
    # where prompts are prefilled: "rules" (decode.local_prefill_threshold and
    # prefill.max_queued_tokens) or "cost" (tandem.placement's cost model: each prompt where the
    # predicted TTFT and TPOT harm leave the most headroom inside the SLOs below), with service
    # times from `perf_model` (`tandem profile`'s JSON; None: the assumed 8B-on-H200 model)
    placement: str = "rules"
    perf_model: str | None = None
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 40.0
    # with "cost" placement: a request is refused (RESOURCE_EXHAUSTED, retry hint) when taking it
    # would slow its decode worker's batch past slo_tpot_ms by the perf model (tandem.placement.BatchGuard)
    batch_guard: bool = True

    def __post_init__(self) -> None:
        if self.placement not in ("rules", "cost"):
            raise ConfigError(f"router: placement must be 'rules' or 'cost', got {self.placement!r}")
        if not (self.slo_ttft_ms > 0 and self.slo_tpot_ms > 0):
            raise ConfigError("router: slo_ttft_ms and slo_tpot_ms must be > 0")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"router: drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_expected_wait_s is not None and not self.max_expected_wait_s > 0:
            raise ConfigError(f"router: max_expected_wait_s must be > 0 or null, got {self.max_expected_wait_s}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"router: port must be in [0, 65535], got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ConfigError(f"router: http_port must be in [0, 65535] or null, got {self.http_port}")


@dataclass(frozen=True)
class ClusterConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill: PoolConfig = field(default_factory=lambda: PoolConfig(resource_name="tandem_prefill"))
    decode: PoolConfig = field(default_factory=lambda: PoolConfig(resource_name="tandem_decode"))
    router: RouterConfig = field(default_factory=RouterConfig)
    autoscale: bool = False  # run the autoscaler (bounds and targets in `autoscaler`)
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    # between prefill and decode actors (docs/architecture.md "KV transfer"); a prefill may queue
    # for minutes before its first layer, hence the long start timeout
    kv_transfer: KVTransferConfig = field(default_factory=lambda: KVTransferConfig(start_timeout_s=600.0))
    # the adaptive layout's role policy (cluster/roles.py); it places prompts by the cost model
    roles: RoleConfig = field(default_factory=RoleConfig)

    def engine_for(self, pool: str) -> EngineConfig:
        """The engine config of `pool`'s workers: the model section's, with the pool's own
        tensor_parallel_size where it sets one (prefill and decode may differ)."""
        tp = getattr(self, pool).tensor_parallel_size
        return self.engine if tp is None else dataclasses.replace(self.engine, tensor_parallel_size=tp)

    def __post_init__(self) -> None:
        decoding = [name for name in ("prefill", "decode")
                    if (getattr(self, name).role or name) in ("decode", "mixed")]
        if not self.autoscale and not sum(getattr(self, name).replicas for name in decoding):
            raise ConfigError(f"no worker would decode: the {' and '.join(decoding) or 'no'} pool's replicas are 0 "
                              "and the autoscaler is off; give --decode 1 or more (decode.replicas), "
                              "or run with --autoscale (its decode_min is at least 1)")
        if self.roles.enabled and self.router.placement != "cost":
            raise ConfigError("roles.enabled needs router.placement: cost (the role policy and the router "
                              "decide from the same cost model); `tandem up --layout adaptive` sets both")


# what `tandem up --layout adaptive` sets: every decode worker decodes and prefills ("mixed"), the
# router places each prompt by the cost model (its own prefill or another worker's: the decode
# worker follows, threshold 0), and the role policy lends workers to prefill only
ADAPTIVE = {"roles.enabled": True, "router.placement": "cost", "decode.role": "mixed",
            "decode.local_prefill_threshold": 0}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _build(cls, values: dict[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"config: unknown key(s) {sorted(unknown)} in {where or 'top level'}; "
                          f"known: {sorted(names)}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"config: {where}: {e}") from None


def _inf(v: Any) -> Any:
    return math.inf if isinstance(v, str) and v.lower() in ("inf", "infinity", ".inf") else v


def config_to_dict(cfg: ClusterConfig) -> dict[str, Any]:
    e = cfg.engine
    return {
        "model": {"name": e.model, "dtype": e.dtype, "device": e.device, "seed": e.seed, "warmup": e.warmup,
                  "tensor_parallel_size": e.tensor_parallel_size},
        "cache": dataclasses.asdict(e.cache),
        "scheduler": dataclasses.asdict(e.scheduler),
        "speculative": dataclasses.asdict(e.speculative),
        "prefill": dataclasses.asdict(cfg.prefill),
        "decode": dataclasses.asdict(cfg.decode),
        "router": dataclasses.asdict(cfg.router),
        "autoscaler": {"enabled": cfg.autoscale, **cfg.autoscaler.to_dict()},
        "kv_transfer": dataclasses.asdict(cfg.kv_transfer),
        "roles": dataclasses.asdict(cfg.roles),
    }


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Defaults, then the YAML file at `path`, then dotted `overrides` whose value is not None."""
    data = config_to_dict(ClusterConfig())
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"config: cannot read {path}: {e.strerror or e}") from None
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {path} is not valid YAML: {str(e).splitlines()[0]}"
                              + (f" (line {e.problem_mark.line + 1})" if getattr(e, "problem_mark", None) else "")) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {path} must hold a mapping at the top level")
        unknown = set(loaded) - set(data)
        if unknown:
            raise ConfigError(f"config: unknown section(s) {sorted(unknown)} in {path}; known: {sorted(data)}")
        data = _merge(data, loaded)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        if section not in data or not key:
            raise ConfigError(f"config: bad override {dotted!r}")
        data[section][key] = value
    m = data["model"]
    engine = _build(EngineConfig, {
        "model": m.pop("name"), **m,
        "cache": _build(CacheConfig, data["cache"], "cache"),
        "scheduler": _build(SchedulerConfig, data["scheduler"], "scheduler"),
        "speculative": _build(SpeculativeConfig, data["speculative"], "speculative"),
    }, "model")
    pools = {p: _build(PoolConfig, {k: _inf(v) for k, v in data[p].items()}, p) for p in ("prefill", "decode")}
    auto = dict(data["autoscaler"])
    enabled = bool(auto.pop("enabled", False))
    try:
        transfer = _build(KVTransferConfig, data["kv_transfer"], "kv_transfer")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return ClusterConfig(engine=engine, router=_build(RouterConfig, data["router"], "router"),
                         autoscale=enabled, autoscaler=AutoscalerConfig.from_dict(auto),
                         kv_transfer=transfer, roles=_build(RoleConfig, data["roles"], "roles"), **pools)
