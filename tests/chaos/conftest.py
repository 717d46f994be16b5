from tests.cluster.conftest import make_cluster, ray_session  # noqa: F401  (the same real-Ray fixtures)
