"""TLS and mutual TLS for the router's gRPC port, and the matching client channel credentials.

`TLSConfig` names the server's PEM files and checks them when it is made (files exist, the key
matches the certificate, the CA file parses), so a mistake fails at startup with a clear message
instead of at the first handshake. `server_credentials` builds gRPC credentials that re-read the
files when they change (cert-manager and Kubernetes Secret rotation need no restart).
With `require_client_cert`, clients must present a certificate signed by `client_ca_file` (mTLS).
`ClientTLSConfig` + `channel_credentials` are the client side for `tandem chat` / `tandem status`.
`server_ssl_context` is the same configuration for the OpenAI HTTP edge (read once, at start).
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


class TLSConfigError(ValueError):
    """A TLS file is missing, unreadable or does not fit; the message names it."""


def _readable(what: str, path: str | None) -> None:
    if path is None:
        return
    p = Path(path)
    if not p.is_file():
        raise TLSConfigError(f"tls: {what} {path} does not exist or is not a file")
    if not os.access(p, os.R_OK):
        raise TLSConfigError(f"tls: {what} {path} is not readable by this process")


def _check_ca(what: str, path: str) -> None:
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, ValueError) as e:
        raise TLSConfigError(f"tls: {what} {path} holds no PEM CA certificate ({e})") from None


def _check_pair(cert_file: str, key_file: str) -> None:
    try:
        # An empty password: an encrypted key fails here instead of OpenSSL prompting on a tty.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file, password=b"")
    except ssl.SSLError as e:
        raise TLSConfigError(f"tls: {cert_file} and {key_file} are not a PEM certificate and its "
                             f"unencrypted private key ({e.reason or e})") from None


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str  # PEM, the server's certificate (chain); its SANs must name the host clients dial
    key_file: str  # PEM, unencrypted private key of cert_file
    client_ca_file: str | None = None  # PEM CA(s) that sign client certificates (mTLS)
    require_client_cert: bool = False  # mTLS: refuse clients without a certificate from client_ca_file

    def __post_init__(self) -> None:
        _readable("cert_file", self.cert_file)
        _readable("key_file", self.key_file)
        _readable("client_ca_file", self.client_ca_file)
        if self.require_client_cert and not self.client_ca_file:
            raise TLSConfigError("tls: require_client_cert needs client_ca_file, the CA that signs "
                                 "client certificates")
        if self.client_ca_file and not self.require_client_cert:
            raise TLSConfigError("tls: client_ca_file is only used with require_client_cert=True "
                                 "(mutual TLS); set both or neither")
        _check_pair(self.cert_file, self.key_file)
        if self.client_ca_file:
            _check_ca("client_ca_file", self.client_ca_file)

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f)


def _stamp(paths: tuple[str, ...]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)  # follows a Secret volume's symlinks to the current version
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def _certificate_configuration(cfg: TLSConfig):
    pair = (Path(cfg.key_file).read_bytes(), Path(cfg.cert_file).read_bytes())
    ca = Path(cfg.client_ca_file).read_bytes() if cfg.client_ca_file else None
    return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)


def server_credentials(cfg: TLSConfig, *, reload: bool = True) -> grpc.ServerCredentials:
    """Credentials for `server.add_secure_port(address, creds)`.

    reload=True re-reads the files for new handshakes once they change (checked by stat at each
    handshake); established connections keep their session. A half-written update is skipped
    until the files fit together again.
    """
    if not reload:
        pair = (Path(cfg.key_file).read_bytes(), Path(cfg.cert_file).read_bytes())
        ca = Path(cfg.client_ca_file).read_bytes() if cfg.client_ca_file else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                           require_client_auth=cfg.require_client_cert)
    last = [_stamp(cfg.files())]

    def fetch():  # called by gRPC's core before handshakes; None keeps the current configuration
        stamp = _stamp(cfg.files())
        if stamp == last[0]:
            return None
        try:
            TLSConfig(cfg.cert_file, cfg.key_file, cfg.client_ca_file, cfg.require_client_cert)
            config = _certificate_configuration(cfg)
        except (TLSConfigError, OSError) as e:
            log.warning("tls: keeping the current certificates, the new files do not load: %s", e)
            return None
        last[0] = stamp
        log.info("tls: loaded new certificates from %s", cfg.cert_file)
        return config

    return grpc.dynamic_ssl_server_credentials(
        _certificate_configuration(cfg), fetch,
        require_client_authentication=cfg.require_client_cert)


def server_ssl_context(cfg: TLSConfig) -> ssl.SSLContext:
    """The TLS configuration for the HTTP edge (router/openai_api.py); its files are read once."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    if cfg.client_ca_file:
        ctx.load_verify_locations(cfg.client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
    return ctx


@dataclass(frozen=True)
class ClientTLSConfig:
    ca_file: str | None = None  # PEM CA that signed the server's certificate; None: system roots
    cert_file: str | None = None  # client certificate, for servers that require one (mTLS)
    key_file: str | None = None
    server_name: str | None = None  # check the server's certificate for this name, not the dialed host

    def __post_init__(self) -> None:
        for what in ("ca_file", "cert_file", "key_file"):
            _readable(what, getattr(self, what))
        if (self.cert_file is None) != (self.key_file is None):
            raise TLSConfigError("tls: give the client cert_file and key_file together")
        if self.cert_file and self.key_file:
            _check_pair(self.cert_file, self.key_file)
        if self.ca_file:
            _check_ca("ca_file", self.ca_file)


def channel_credentials(cfg: ClientTLSConfig) -> grpc.ChannelCredentials:
    """`grpc.aio.secure_channel(target, channel_credentials(cfg), options=channel_options(cfg))`."""
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(root_certificates=read(cfg.ca_file),
                                        private_key=read(cfg.key_file),
                                        certificate_chain=read(cfg.cert_file))


def channel_options(cfg: ClientTLSConfig) -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", cfg.server_name)] if cfg.server_name else []
