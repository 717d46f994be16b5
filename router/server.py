"""The gRPC front door: `tandem.v1.Generation` (server streaming), `tandem.v1.Admin`
(router/admin.py), health and reflection. Admission and the client's identity are taken here; the
request itself is router/generation.py's. Errors leave as status codes here, mapped once by
router/status_codes.py.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.perf_model import PerfModel
from tandem.placement import OverloadLimits
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from tandem.router.admin import AdminService, publish_cluster_metrics
from tandem.router.admission import AdmissionConfig, client_identity, retry_hint
from tandem.router.auth import bearer_token
from tandem.router.cluster_view import ClusterView
from tandem.router.generation import Router
from tandem.router.health import SERVING, HealthFollower, serve_health
from tandem.router.placing import CostPlacement
from tandem.router.malformed import MalformedRequestInterceptor
from tandem.router.openai_api import serve_http
from tandem.router.sessions import make_session_store
from tandem.router.status_codes import client_message, status_code
from tandem.router.validation import RequestLimits

log = logging.getLogger(__name__)

class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request, context):
        client = client_identity(context.peer(), bearer_token(context.invocation_metadata()))
        try:
            left = context.time_remaining()
            deadline = None if left is None else time.monotonic() + left
            async for resp in self.router.admit_and_generate(request, client, deadline):
                yield resp
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure leaves as a status, never UNKNOWN
            await self._abort(context, e)

    async def _abort(self, context, e: Exception) -> None:
        """`e` as its status code, with one line for the client (router/status_codes.py); the
        detail of a failure in the cluster was logged under the request's id (Router.generate)."""
        code = status_code(e)
        self.router.record_error(e, code.name)
        trailing = retry_hint(e)     # a shed request's hint (the limiter's, the workers' overload)
        await context.abort(code, client_message(e, getattr(e, "tandem_request_id", None)),
                            trailing_metadata=trailing)


def cost_placement(rc) -> CostPlacement | None:
    """The router's cost model when `router.placement` is "cost"."""
    if rc.placement != "cost":
        return None
    return CostPlacement(PerfModel.load(rc.perf_model), rc.slo_ttft_ms / 1e3, rc.slo_tpot_ms / 1e3, rc.batch_guard)


async def serve(controller, config, namespace: str, tokenizer, model_config,
                interceptors=(), credentials=None, token_store=None,
                ssl_context=None) -> tuple[grpc.aio.Server, Router, int]:
    """Start the router's gRPC server, and its OpenAI HTTP edge unless `router.http_port` is None
    (then `router.http` is its aiohttp runner and `router.http_port` its port; `token_store`: the
    bearer tokens it accepts, None: auth off; `ssl_context`: HTTPS, as `credentials` for gRPC);
    returns (server, router, bound gRPC port)."""
    rc = config.router
    limits = RequestLimits()
    view = ClusterView(controller, f"router-{uuid.uuid4().hex[:8]}", namespace)
    await view.start()
    sessions = make_session_store(rc.redis_url, rc.session_ttl_s)
    router = Router(view, tokenizer, model_config, config.engine.cache.block_size, sessions, limits,
                    config.decode.local_prefill_threshold,
                    AdmissionConfig.of(rc),
                    config.prefill.max_queued_tokens,
                    OverloadLimits.of(rc),
                    cost_placement(rc))
    router.slow_ttft_s = rc.slow_ttft_log_s
    server = grpc.aio.server(interceptors=[*interceptors, MalformedRequestInterceptor()], options=[
        ("grpc.max_receive_message_length", limits.grpc_max_receive_bytes),
        ("grpc.max_send_message_length", 64 << 20)])
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(router), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(controller), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
             admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    addr = f"{rc.host}:{rc.port}"
    port = server.add_secure_port(addr, credentials) if credentials else server.add_insecure_port(addr)
    await server.start()
    await health_servicer.set(names[1], SERVING)   # Admin works without workers
    # Generation (and "") follow whether a request can be served end to end (router/health.py)
    follower = HealthFollower(health_servicer, ("", names[0]), reachable=lambda wid: wid in view.handles)
    follower.follow(view.state.workers)

    def on_refresh(state) -> None:
        publish_cluster_metrics(router.hub, state)
        follower.follow(state.workers)

    view.on_refresh = on_refresh
    router.health = health_servicer
    router.health_server = None
    if rc.health_port is not None:     # plaintext, health only: for probes that cannot speak TLS
        router.health_server, _ = await serve_health(health_servicer, rc.host, rc.health_port)
    router.http, router.http_port = None, None
    if rc.http_port is not None:
        router.http, router.http_port = await serve_http(router, config.engine.model, rc.host, rc.http_port,
                                                         token_store, ssl_context)
    return server, router, port
