"""Bearer-token authentication for the router's gRPC API, and the policy for when it is on.

Server side: `TokenStore` holds the accepted tokens, from a file (one per line, `#` comments), a
directory (a Kubernetes Secret mounted as a volume: each non-hidden file is one token) and/or the
`TANDEM_AUTH_TOKEN` environment variable (comma-separated); the file or directory is re-read when
it changes, checked at most once per `recheck_s`. `BearerTokenInterceptor` rejects a call without a
valid `authorization: Bearer <token>` with UNAUTHENTICATED, never echoing what was sent; health
checks and reflection stay open. Tokens are compared as SHA-256 digests with `hmac.compare_digest`,
against every accepted token, so timing reveals neither a token nor which one matched.

Admin tokens are distinct: `tandem.v1.Admin` (status, draining, pool bounds, roles) takes only a
token of the admin store (`--admin-token-file`, `TANDEM_ADMIN_TOKEN`); a client token gets
PERMISSION_DENIED there, and so does every token when auth is on and no admin token is configured
(fail closed). An admin token is accepted on Generation too.

Policy: `resolve_auth` decides from the listen host and the flags whether auth is on, and refuses
to serve without auth on a non-loopback address unless the operator says so twice.

Client side: `load_client_token` and `auth_metadata` (plaintext channels) or `call_credentials`
(TLS channels) for `tandem chat` / `tandem status`.
"""

from __future__ import annotations

import collections

import hashlib
import hmac
import ipaddress
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import grpc

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
TOKEN_ENV = "TANDEM_AUTH_TOKEN"
ADMIN_TOKEN_ENV = "TANDEM_ADMIN_TOKEN"
ADMIN_METHOD_PREFIX = "/tandem.v1.Admin/"
NO_ADMIN = ("the Admin API takes an admin token, not a client token: send one of the router's admin tokens "
            f"(--admin-token-file or ${ADMIN_TOKEN_ENV} on the router)")
EXPECTED = "send gRPC metadata 'authorization: Bearer <token>'"
# Methods anyone may call: load balancers probe health, and tools (grpcurl) need reflection.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
)
MIN_TOKEN_CHARS = 16  # shorter tokens work, with a warning


class AuthConfigError(ValueError):
    """Auth is misconfigured; the message says how to fix it. The CLI prints it and exits 2."""


# --- policy ------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    host = host.strip().strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname, "0.0.0.0", "::", "": reachable from elsewhere


def auth_required_by_default(host: str) -> bool:
    """Auth is required when the router listens on anything but loopback."""
    return not is_loopback(host)


@dataclass(frozen=True)
class AuthDecision:
    enabled: bool
    warning: str | None = None  # log it at WARNING when set


def resolve_auth(host: str, *, token_file: str | None = None, env_token: str | None = None,
                 no_auth: bool = False, insecure_no_auth: bool = False) -> AuthDecision:
    """Whether the router checks tokens, from its listen `host` and the operator's choices:

    - `--auth-token-file` or `TANDEM_AUTH_TOKEN` (env_token) turns auth on, on any host;
    - `--no-auth` turns it off on loopback; on any other host it also needs `--insecure-no-auth`
      (which alone implies `--no-auth`); an explicit `--no-auth` wins over the env variable;
    - with none of them, auth is off on loopback, and a non-loopback host is refused.
    Raises AuthConfigError with what to do when the combination is refused.
    """
    off = no_auth or insecure_no_auth
    if off and token_file:
        raise AuthConfigError("--no-auth and --auth-token-file contradict each other; give one")
    if not off and (token_file or (env_token and env_token.strip())):
        return AuthDecision(True)
    if is_loopback(host):
        return AuthDecision(False)
    if insecure_no_auth:
        return AuthDecision(False, f"auth is OFF while listening on {host}: anyone who can reach "
                                   "this port can generate with your GPUs (--insecure-no-auth)")
    if no_auth:
        raise AuthConfigError(
            f"--no-auth on {host} would serve anyone who can reach this port; add "
            "--insecure-no-auth if that is really intended, or listen on 127.0.0.1")
    raise AuthConfigError(
        f"the router listens on {host}, reachable from other machines, so it needs auth: give "
        f"--auth-token-file PATH (a file with one token a line, or a directory such as a mounted "
        f"Kubernetes Secret) or set {TOKEN_ENV}; to serve without auth pass --no-auth "
        "--insecure-no-auth")


# --- tokens ------------------------------------------------------------------------------------


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _parse_file(text: str) -> list[str]:
    tokens = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            tokens.append(line)
    return tokens


def _signature(path: Path) -> tuple:
    """Changes when the file, or any token file in the directory, is replaced or rewritten."""
    try:
        st = path.stat()
    except OSError:
        return ("missing",)
    if not path.is_dir():
        return (st.st_mtime_ns, st.st_size, st.st_ino)
    entries = []
    for child in sorted(path.iterdir()):
        if child.name.startswith("."):  # a Secret volume's ..data and timestamped dirs
            continue
        try:
            cst = child.stat()  # follows the Secret's symlinks to the current version
        except OSError:
            continue
        entries.append((child.name, cst.st_mtime_ns, cst.st_size, cst.st_ino))
    return (st.st_mtime_ns, tuple(entries))


def _read_tokens(path: Path) -> list[str]:
    if path.is_dir():
        tokens = []
        for child in sorted(path.iterdir()):
            if not child.name.startswith(".") and child.is_file():
                token = child.read_text().strip()
                if token:
                    tokens.append(token)
        return tokens
    return _parse_file(path.read_text())


class TokenStore:
    """The accepted tokens (only their SHA-256 digests are kept)."""

    def __init__(self, path: str | os.PathLike | None = None, env_value: str | None = None, *,
                 recheck_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._path = Path(path) if path is not None else None
        self._env = [t.strip() for t in (env_value or "").split(",") if t.strip()]
        self._recheck_s, self._clock = recheck_s, clock
        self._digests: tuple[bytes, ...] = ()
        self._signature: tuple | None = None
        self._next_check = float("-inf")
        if self._path is not None and not self._path.exists():
            raise AuthConfigError(f"auth token file {self._path} does not exist")
        self._refresh(force=True)
        if not self._digests:
            where = f"{self._path}" if self._path else f"${TOKEN_ENV}"
            raise AuthConfigError(f"no auth tokens in {where}: give at least one token")

    @classmethod
    def from_sources(cls, token_file: str | None = None,
                     environ: Mapping[str, str] = os.environ, **kw) -> "TokenStore":
        return cls(token_file, environ.get(TOKEN_ENV), **kw)

    @classmethod
    def admin_from_sources(cls, token_file: str | None = None,
                           environ: Mapping[str, str] = os.environ, **kw) -> "TokenStore | None":
        """The admin tokens (`--admin-token-file`, $TANDEM_ADMIN_TOKEN); None when neither is given."""
        env = environ.get(ADMIN_TOKEN_ENV, "").strip()
        return cls(token_file, env or None, **kw) if token_file or env else None

    def __len__(self) -> int:
        self._refresh()
        return len(self._digests)

    def verify(self, token: str) -> bool:
        self._refresh()
        presented = _digest(token)
        ok = False
        for accepted in self._digests:  # no early exit: the time does not depend on which matched
            ok |= hmac.compare_digest(presented, accepted)
        return ok

    def _refresh(self, force: bool = False) -> None:
        now = self._clock()
        if not force and (self._path is None or now < self._next_check):
            return
        self._next_check = now + self._recheck_s
        file_tokens: list[str] = []
        if self._path is not None:
            signature = _signature(self._path)
            if signature == self._signature and not force:
                return
            self._signature = signature
            try:
                file_tokens = _read_tokens(self._path)
            except OSError as e:
                log.error("auth: cannot read %s (%s); only %s tokens are accepted until it is back",
                          self._path, e.strerror, TOKEN_ENV)
            else:
                log.info("auth: loaded %d token(s) from %s", len(file_tokens), self._path)
        tokens = file_tokens + self._env
        short = sum(len(t) < MIN_TOKEN_CHARS for t in tokens)
        if short:
            log.warning("auth: %d token(s) shorter than %d characters; use long random tokens "
                        "(openssl rand -hex 32)", short, MIN_TOKEN_CHARS)
        self._digests = tuple(_digest(t) for t in tokens)


# --- the interceptor ---------------------------------------------------------------------------


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` entry; None when there is none."""
    for key, value in metadata or ():
        if key.lower() != AUTH_HEADER:
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def _denied(handler: grpc.RpcMethodHandler, message: str,
            code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator, context):
        await context.abort(code, message)

    # No deserializer: the rejected request stays bytes, never parsed.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with a token `store` accepts (open methods excepted); Admin calls
    only with one `admin` accepts. `store` None: Generation is open (auth off on loopback)."""

    def __init__(self, store: TokenStore | None, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES,
                 admin: TokenStore | None = None):
        self._store = store
        self._open = open_prefixes
        self._admin = admin

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._open):
            return handler
        is_admin = method.startswith(ADMIN_METHOD_PREFIX)
        if self._store is None and (not is_admin or self._admin is None):
            return handler    # auth off (and, for Admin, no admin tokens either)
        token = bearer_token(handler_call_details.invocation_metadata)
        if token is None:
            return _denied(handler, f"missing credentials: {EXPECTED}")
        if self._admin is not None and self._admin.verify(token):
            return handler    # an admin token may call anything
        client_ok = self._store is not None and self._store.verify(token)
        if is_admin and client_ok:
            log.info("auth: refused a client token on %s", method)
            return _denied(handler, NO_ADMIN, grpc.StatusCode.PERMISSION_DENIED)
        if client_ok:
            return handler
        log.info("auth: rejected a token for %s", method)
        return _denied(handler, f"invalid token: {EXPECTED} with a token this server accepts")


# --- clients -----------------------------------------------------------------------------------


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata to send with each call (`stub.Generate(req, metadata=auth_metadata(t))`)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def call_credentials(token: str) -> grpc.CallCredentials:
    """Per-call credentials for a TLS channel (gRPC sends them only over secure channels):
    `grpc.composite_channel_credentials(tls_creds, call_credentials(token))`."""
    return grpc.access_token_call_credentials(token)


def load_client_token(token: str | None = None, token_file: str | None = None,
                      environ: Mapping[str, str] = os.environ) -> str | None:
    """The token a client sends: the given one, else the first in `token_file`, else the first
    in $TANDEM_AUTH_TOKEN; None when there is none (the server may not need one)."""
    if token:
        return token.strip()
    if token_file:
        path = Path(token_file)
        if not path.exists():
            raise AuthConfigError(f"auth token file {path} does not exist")
        tokens = _read_tokens(path)
        if not tokens:
            raise AuthConfigError(f"no auth token in {path}")
        return tokens[0]
    env = [t.strip() for t in environ.get(TOKEN_ENV, "").split(",") if t.strip()]
    return env[0] if env else None


def load_admin_token(token_file: str | None = None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token an admin command (`tandem status`, `scale`, `set-role`) sends: the first in
    `token_file`, else in $TANDEM_ADMIN_TOKEN, else the client token (`load_client_token`)."""
    if token_file:
        return load_client_token(token_file=token_file)
    env = [t.strip() for t in environ.get(ADMIN_TOKEN_ENV, "").split(",") if t.strip()]
    return env[0] if env else load_client_token(environ=environ)


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                          "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata):
        self.metadata = tuple(metadata)

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, tuple(d.metadata or ()) + self.metadata, d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def with_metadata(channel: grpc.Channel, metadata) -> grpc.Channel:
    """A plaintext channel that sends `metadata` (e.g. `auth_metadata(token)`) on every call."""
    return grpc.intercept_channel(channel, _AddMetadata(metadata)) if metadata else channel
