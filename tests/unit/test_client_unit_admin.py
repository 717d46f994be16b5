"""tandem.client sends the admin token (not the client token) on Admin calls: the router's Admin API
refuses client tokens."""

from __future__ import annotations

from tandem.client import Client
from tandem.protos.tandem.v1 import admin_pb2


def test_admin_calls_carry_the_admin_token_and_generation_the_client_token():
    seen = []

    def method(req, timeout, metadata):
        seen.append(metadata)
        return admin_pb2.ClusterState()

    c = Client("127.0.0.1:9", token="client-tok", admin_token="admin-tok")
    c._call(method, admin_pb2.GetClusterStateRequest())
    assert seen == [(("authorization", "Bearer admin-tok"),)]
    assert c.metadata == (("authorization", "Bearer client-tok"),)
    assert Client("127.0.0.1:9", token="only").admin_metadata == (("authorization", "Bearer only"),)
    c.close()
