"""router.auth and router.tls against a real grpc.aio server on 127.0.0.1 (a tiny Generation
servicer streaming three messages, plus health and reflection). Certificates are made in the test."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
import subprocess
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from tandem.router.auth import (AuthConfigError, BearerTokenInterceptor, TokenStore, auth_metadata,
                         auth_required_by_default, call_credentials, load_client_token,
                         resolve_auth)
from tandem.router.openai_api import serve_http
from tandem.router.tls import (ClientTLSConfig, TLSConfig, TLSConfigError, channel_credentials,
                        channel_options, server_credentials, server_ssl_context)
from tandem.router.validation import RequestLimits

GOOD = "good-token-0123456789abcdef"
GEN = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class ThreeTokens(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        for i in range(3):
            yield generation_pb2.GenerateResponse(token_ids=[i], text=str(i))


class EmptyAdmin(admin_pb2_grpc.AdminServicer):
    async def GetClusterState(self, request, context):
        return admin_pb2.ClusterState()


async def start_server(interceptors=(), creds=None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=list(interceptors))
    generation_pb2_grpc.add_GenerationServicer_to_server(ThreeTokens(), server)
    admin_pb2_grpc.add_AdminServicer_to_server(EmptyAdmin(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    reflection.enable_server_reflection([GEN, reflection.SERVICE_NAME], server)
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    await server.start()
    return server, port


async def generate(channel, metadata=(), timeout=5.0) -> list[str]:
    stub = generation_pb2_grpc.GenerationStub(channel)
    call = stub.Generate(generation_pb2.GenerateRequest(prompt="hi"), metadata=metadata,
                         timeout=timeout)
    return [m.text async for m in call]


async def status_of(coro) -> tuple[grpc.StatusCode, str]:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


# --- bearer tokens ----------------------------------------------------------------------------

ADMIN = "admin-token-fedcba9876543210"


def test_the_admin_api_refuses_client_tokens_and_takes_admin_tokens():
    """Issue 27 item 5: any client token could drain workers and set pool bounds."""
    async def main():
        icp = BearerTokenInterceptor(TokenStore(None, GOOD), admin=TokenStore(None, ADMIN))
        server, port = await start_server([icp])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                admin = admin_pb2_grpc.AdminStub(ch)
                code, details = await status_of(admin.GetClusterState(admin_pb2.GetClusterStateRequest(),
                                                                      metadata=auth_metadata(GOOD)))
                assert code == grpc.StatusCode.PERMISSION_DENIED and "admin token" in details
                assert GOOD not in details
                code, _ = await status_of(admin.GetClusterState(admin_pb2.GetClusterStateRequest(),
                                                                metadata=auth_metadata("wrong-token-xxxxxxxxxx")))
                assert code == grpc.StatusCode.UNAUTHENTICATED
                await admin.GetClusterState(admin_pb2.GetClusterStateRequest(), metadata=auth_metadata(ADMIN))
                assert await generate(ch, auth_metadata(GOOD)) == ["0", "1", "2"]
                assert await generate(ch, auth_metadata(ADMIN)) == ["0", "1", "2"]
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_metrics_behind_the_admin_token():
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter

    from tandem.runtime.metrics import start_metrics_server

    reg = CollectorRegistry()
    Counter("probe_total", "a probe", registry=reg).inc()
    port = start_metrics_server(0, "127.0.0.1", registry=reg, verify=TokenStore(None, ADMIN).verify)
    url = f"http://127.0.0.1:{port}/metrics"
    for headers in ({}, {"Authorization": f"Bearer {GOOD}"}):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5)
        assert err.value.code == 401
    body = urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN}"}),
                                  timeout=5).read().decode()
    assert "probe_total 1.0" in body


def test_tokens_gate_generation_but_not_health_or_reflection():
    async def main():
        server, port = await start_server([BearerTokenInterceptor(TokenStore(None, GOOD))])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert await generate(ch, auth_metadata(GOOD)) == ["0", "1", "2"]
                assert await generate(ch, [("authorization", f"bearer  {GOOD} ")]) == ["0", "1", "2"]

                code, details = await status_of(generate(ch))
                assert code == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization: Bearer <token>" in details

                wrong = "wrong-token-that-must-not-be-echoed"
                for md in (auth_metadata(wrong), [("authorization", f"Basic {GOOD}")],
                           auth_metadata(GOOD + "x")):
                    code, details = await status_of(generate(ch, md))
                    assert code == grpc.StatusCode.UNAUTHENTICATED, md
                    assert wrong not in details and GOOD not in details

                admin = admin_pb2_grpc.AdminStub(ch)  # unary: the Admin service is gated too
                code, _ = await status_of(admin.GetClusterState(admin_pb2.GetClusterStateRequest()))
                assert code == grpc.StatusCode.UNAUTHENTICATED
                # no admin token configured: Admin refuses every token (fail closed)
                code, details = await status_of(admin.GetClusterState(admin_pb2.GetClusterStateRequest(),
                                                                      metadata=auth_metadata(GOOD)))
                assert code == grpc.StatusCode.PERMISSION_DENIED and "admin token" in details

                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                refl = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = [s.name async for r in refl for s in r.list_services_response.service]
                assert GEN in names
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_token_file_reloads_when_it_changes(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# ops team\nfirst-token-aaaaaaaaaaaa\n\n  second-token-bbbbbbbbbbb  \n")
    now = [0.0]
    store = TokenStore(path, recheck_s=1.0, clock=lambda: now[0])
    assert len(store) == 2 and store.verify("second-token-bbbbbbbbbbb")
    assert not store.verify("# ops team") and not store.verify("")

    new = tmp_path / "tokens.new"
    new.write_text("third-token-ccccccccccccc\n")
    os.replace(new, path)  # how operators (and editors) should update it: atomically
    assert store.verify("first-token-aaaaaaaaaaaa")  # not re-checked within recheck_s
    now[0] = 1.5
    assert store.verify("third-token-ccccccccccccc")
    assert not store.verify("first-token-aaaaaaaaaaaa")

    path.unlink()  # gone: fail closed, except for the env tokens
    now[0] = 3.0
    assert not store.verify("third-token-ccccccccccccc")


def test_secret_volume_directory_and_rotation(tmp_path):
    # The layout kubelet writes: token -> ..data/token, ..data -> ..<timestamp>, swapped atomically.
    secret = tmp_path / "secret"
    (secret / "..v1").mkdir(parents=True)
    (secret / "..v1" / "token").write_text("secret-token-one-1111111\n")
    (secret / "..v1" / "ci").write_text("secret-token-ci-22222222")
    (secret / "..data").symlink_to("..v1")
    for name in ("token", "ci"):
        (secret / name).symlink_to(f"..data/{name}")
    store = TokenStore(secret, recheck_s=0.0)
    assert store.verify("secret-token-one-1111111") and store.verify("secret-token-ci-22222222")
    assert len(store) == 2

    (secret / "..v2").mkdir()
    (secret / "..v2" / "token").write_text("secret-token-two-3333333")
    (secret / "..v2" / "ci").write_text("secret-token-ci-22222222")
    (secret / "..data.tmp").symlink_to("..v2")
    os.replace(secret / "..data.tmp", secret / "..data")
    assert store.verify("secret-token-two-3333333")
    assert not store.verify("secret-token-one-1111111")


def test_token_sources_and_errors(tmp_path):
    env = {"TANDEM_AUTH_TOKEN": " a-long-token-aaaaaaa, b-long-token-bbbbbbb ,"}
    store = TokenStore.from_sources(None, environ=env)
    assert len(store) == 2 and store.verify("b-long-token-bbbbbbb")
    with pytest.raises(AuthConfigError, match="does not exist"):
        TokenStore(tmp_path / "nope")
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(AuthConfigError, match="no auth tokens"):
        TokenStore(tmp_path / "empty")

    (tmp_path / "client").write_text("# mine\nclient-token-xxxxxxxxx\n")
    assert load_client_token("given", tmp_path / "client", environ={}) == "given"
    assert load_client_token(None, str(tmp_path / "client"), environ={}) == "client-token-xxxxxxxxx"
    assert load_client_token(environ={"TANDEM_AUTH_TOKEN": "e1,e2"}) == "e1"
    assert load_client_token(environ={}) is None
    assert auth_metadata(None) == ()


@pytest.mark.parametrize("host,required", [
    ("127.0.0.1", False), ("127.3.4.5", False), ("::1", False), ("[::1]", False),
    ("localhost", False), ("0.0.0.0", True), ("::", True), ("", True), ("10.0.0.7", True),
    ("router.example.com", True)])
def test_auth_required_off_loopback(host, required):
    assert auth_required_by_default(host) is required


def test_auth_policy():
    assert not resolve_auth("127.0.0.1").enabled
    assert resolve_auth("127.0.0.1", env_token="t").enabled  # explicit: on anywhere
    assert resolve_auth("0.0.0.0", token_file="/run/tokens").enabled
    assert not resolve_auth("127.0.0.1", no_auth=True).enabled
    assert not resolve_auth("0.0.0.0", env_token="t", no_auth=True, insecure_no_auth=True).enabled
    decision = resolve_auth("0.0.0.0", no_auth=True, insecure_no_auth=True)
    assert not decision.enabled and "OFF" in decision.warning
    with pytest.raises(AuthConfigError, match="needs auth: give --auth-token-file"):
        resolve_auth("0.0.0.0")
    with pytest.raises(AuthConfigError, match="--insecure-no-auth"):
        resolve_auth("10.1.2.3", no_auth=True)
    with pytest.raises(AuthConfigError, match="contradict"):
        resolve_auth("127.0.0.1", token_file="/x", no_auth=True)


# --- TLS and mTLS -----------------------------------------------------------------------------


def _pki_cryptography(d: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name, key, cert):
        (d / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def make(name, issuer=None, *, ca=False, sans=(), usage=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_name, issuer_key = (issuer[1].subject, issuer[0]) if issuer else (subject, key)
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if ca:
            b = b.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                              False), critical=True)
        cert = b.sign(issuer_key, hashes.SHA256())
        write(name, key, cert)
        return key, cert

    ca = make("ca", ca=True)
    other_ca = make("other-ca", ca=True)
    make("server", ca, sans=[x509.DNSName("localhost"),
                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
         usage=ExtendedKeyUsageOID.SERVER_AUTH)
    make("client", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    make("rogue-client", other_ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    make("other-server", other_ca, sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
         usage=ExtendedKeyUsageOID.SERVER_AUTH)


def _pki_openssl(d: Path) -> None:
    def sh(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    def key(name):
        sh("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.ec")
        sh("pkcs8", "-topk8", "-nocrypt", "-in", f"{name}.ec", "-out", f"{name}.key")

    for ca in ("ca", "other-ca"):
        key(ca)
        sh("req", "-x509", "-new", "-key", f"{ca}.key", "-subj", f"/CN={ca}", "-days", "1",
           "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
           "keyUsage=critical,keyCertSign,cRLSign", "-out", f"{ca}.pem")
    for name, ca, ext in (
            ("server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
            ("client", "ca", "extendedKeyUsage=clientAuth"),
            ("rogue-client", "other-ca", "extendedKeyUsage=clientAuth"),
            ("other-server", "other-ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth")):
        key(name)
        (d / f"{name}.ext").write_text(ext + "\n")
        sh("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={name}", "-out", f"{name}.csr")
        sh("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
           "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    try:
        import cryptography  # noqa: F401
    except ImportError:
        _pki_openssl(d)
    else:
        _pki_cryptography(d)
    return d


def _client(pki, ca="ca", cert=None) -> ClientTLSConfig:
    return ClientTLSConfig(ca_file=str(pki / f"{ca}.pem"),
                           cert_file=str(pki / f"{cert}.pem") if cert else None,
                           key_file=str(pki / f"{cert}.key") if cert else None)


async def _tls_generate(port, client_cfg, call_creds=None, metadata=()):
    creds = channel_credentials(client_cfg)
    if call_creds is not None:
        creds = grpc.composite_channel_credentials(creds, call_creds)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds,
                                       options=channel_options(client_cfg)) as ch:
        return await generate(ch, metadata, timeout=3.0)


def test_tls_and_mutual_tls(pki):
    tls = TLSConfig(str(pki / "server.pem"), str(pki / "server.key"))
    mtls = TLSConfig(str(pki / "server.pem"), str(pki / "server.key"),
                     client_ca_file=str(pki / "ca.pem"), require_client_cert=True)

    async def main():
        server, port = await start_server(creds=server_credentials(tls))
        try:
            assert await _tls_generate(port, _client(pki)) == ["0", "1", "2"]
            code, _ = await status_of(_tls_generate(port, _client(pki, ca="other-ca")))
            assert code == grpc.StatusCode.UNAVAILABLE  # the client does not trust this server
        finally:
            await server.stop(None)

        server, port = await start_server(creds=server_credentials(mtls, reload=False))
        try:
            assert await _tls_generate(port, _client(pki, cert="client")) == ["0", "1", "2"]
            for refused in (_client(pki), _client(pki, cert="rogue-client")):
                code, _ = await status_of(_tls_generate(port, refused))
                assert code == grpc.StatusCode.UNAVAILABLE, refused
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_the_plaintext_health_port_mirrors_the_tls_ports_health_and_serves_nothing_else(pki):
    """router.health_port (router.health.serve_health): the kubelet's gRPC probes cannot speak TLS,
    so a TLS router answers them on a second, plaintext port with only grpc.health.v1 and the same
    servicer: a status set (a drain's NOT_SERVING) shows on both ports, and Generation is not there."""
    from tandem.router.health import NOT_SERVING, SERVING, serve_health

    tls = TLSConfig(str(pki / "server.pem"), str(pki / "server.key"))

    async def check(channel, service):
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=3.0)).status

    async def main():
        servicer = health.aio.HealthServicer()
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(ThreeTokens(), server)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
        await server.start()
        plain, plain_port = await serve_health(servicer, "127.0.0.1", 0)
        try:
            await servicer.set(GEN, SERVING)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plain_port}") as ch, \
                    grpc.aio.secure_channel(f"127.0.0.1:{port}", channel_credentials(_client(pki)),
                                            options=channel_options(_client(pki))) as tls_ch:
                assert await check(ch, GEN) == await check(tls_ch, GEN) == SERVING
                await servicer.enter_graceful_shutdown()            # what a drain does first
                assert await check(ch, GEN) == await check(tls_ch, GEN) == NOT_SERVING
                code, _ = await status_of(generate(ch))
                assert code == grpc.StatusCode.UNIMPLEMENTED         # health only, in plaintext
                code, _ = await status_of(generate(grpc.aio.insecure_channel(f"127.0.0.1:{port}")))
                assert code == grpc.StatusCode.UNAVAILABLE           # the main port stays TLS
        finally:
            await plain.stop(None)
            await server.stop(None)

    asyncio.run(main())


def test_the_http_edge_serves_https_with_the_same_files(pki):
    mtls = TLSConfig(str(pki / "server.pem"), str(pki / "server.key"),
                     client_ca_file=str(pki / "ca.pem"), require_client_cert=True)

    async def main():
        router = SimpleNamespace(limits=RequestLimits())
        runner, port = await serve_http(router, "m", "127.0.0.1", 0, ssl_context=server_ssl_context(mtls))
        try:
            trusting = ssl.create_default_context(cafile=str(pki / "ca.pem"))
            trusting.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
            async with aiohttp.ClientSession() as s:
                async with s.get(f"https://127.0.0.1:{port}/health", ssl=trusting) as r:
                    assert r.status == 200
                no_cert = ssl.create_default_context(cafile=str(pki / "ca.pem"))
                with pytest.raises(aiohttp.ClientError):   # mTLS: no client certificate, no answer
                    async with s.get(f"https://127.0.0.1:{port}/health", ssl=no_cert) as r:
                        await r.read()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_tls_with_token_call_credentials_and_rotation(pki, tmp_path):
    # The server reads its files from a copy, so the test can rotate them under it.
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes((pki / "server.pem").read_bytes())
    key.write_bytes((pki / "server.key").read_bytes())
    tls = TLSConfig(str(cert), str(key))

    async def main():
        server, port = await start_server([BearerTokenInterceptor(TokenStore(None, GOOD))],
                                          server_credentials(tls))
        try:
            assert await _tls_generate(port, _client(pki), call_credentials(GOOD)) == ["0", "1", "2"]
            code, _ = await status_of(_tls_generate(port, _client(pki)))
            assert code == grpc.StatusCode.UNAUTHENTICATED

            new_cert, new_key = tmp_path / "new.crt", tmp_path / "new.key"
            new_cert.write_bytes((pki / "other-server.pem").read_bytes())
            new_key.write_bytes((pki / "other-server.key").read_bytes())
            os.replace(new_key, key)
            os.replace(new_cert, cert)
            md = auth_metadata(GOOD)
            assert await _tls_generate(port, _client(pki, ca="other-ca"), metadata=md) == ["0", "1", "2"]
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_tls_config_errors(pki, tmp_path):
    with pytest.raises(TLSConfigError, match="cert_file .* does not exist"):
        TLSConfig(str(tmp_path / "missing.pem"), str(pki / "server.key"))
    with pytest.raises(TLSConfigError, match="require_client_cert needs client_ca_file"):
        TLSConfig(str(pki / "server.pem"), str(pki / "server.key"), require_client_cert=True)
    with pytest.raises(TLSConfigError, match="only used with require_client_cert"):
        TLSConfig(str(pki / "server.pem"), str(pki / "server.key"), client_ca_file=str(pki / "ca.pem"))
    with pytest.raises(TLSConfigError, match="not a PEM certificate and its"):
        TLSConfig(str(pki / "server.pem"), str(pki / "client.key"))
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(TLSConfigError, match="no PEM CA"):
        TLSConfig(str(pki / "server.pem"), str(pki / "server.key"),
                  client_ca_file=str(tmp_path / "junk.pem"), require_client_cert=True)
    subprocess.run(["openssl", "pkcs8", "-topk8", "-in", str(pki / "server.key"), "-passout",
                    "pass:hunter2", "-out", str(tmp_path / "locked.key")], check=True)
    with pytest.raises(TLSConfigError, match="unencrypted private key"):  # no tty prompt
        TLSConfig(str(pki / "server.pem"), str(tmp_path / "locked.key"))
    with pytest.raises(TLSConfigError, match="together"):
        ClientTLSConfig(cert_file=str(pki / "client.pem"))
