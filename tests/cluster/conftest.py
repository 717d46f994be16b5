"""Cluster fixtures: one local Ray for the session (the pools' custom resources declared, as on
KubeRay), and `RunningCluster`: a real controller, real pool actors and a real gRPC router on
127.0.0.1 inside this test process, so tests can talk gRPC and also read actors' counters."""

from __future__ import annotations

import pytest
import ray

from tandem.cluster.local import RunningCluster


@pytest.fixture(scope="session")
def ray_session():
    if not ray.is_initialized():
        ray.init(num_cpus=8, resources={"tandem_prefill": 64, "tandem_decode": 64}, include_dashboard=False,
                 object_store_memory=256 << 20, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture
def make_cluster(ray_session):
    """Clusters made in a test are shut down when it ends (Ray's CPUs are shared by all of them)."""
    made = []

    def make(overrides: dict, redis_url: str | None = None) -> RunningCluster:
        c = RunningCluster(overrides, redis_url)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
