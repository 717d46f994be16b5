"""Channels to a router: plaintext, or TLS (mutual with a client certificate); the bearer token
goes as call metadata. One builder for the sync and the asyncio client."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

DEFAULT_TARGET = "127.0.0.1:50051"
MAX_MESSAGE_BYTES = 64 << 20   # the router's own send limit


@dataclass(frozen=True)
class TLS:
    """PEM files: the CA that signed the router's certificate, and for mutual TLS the client's own."""
    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None   # the name to check in the router's certificate


def _credentials(tls: TLS) -> grpc.ChannelCredentials:
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(tls.ca_file), read(tls.key_file), read(tls.cert_file))


def _options(tls: TLS | None) -> list[tuple[str, object]]:
    opts: list[tuple[str, object]] = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    if tls is not None and tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return opts


def make_channel(target: str, tls: TLS | None = None, *, aio: bool = False):
    """A grpc (or grpc.aio) channel to `target`."""
    mod = grpc.aio if aio else grpc
    if tls is None:
        return mod.insecure_channel(target, options=_options(None))
    return mod.secure_channel(target, _credentials(tls), options=_options(tls))


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()
