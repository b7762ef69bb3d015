"""Transport security: TLS/mTLS credentials, secure port binding, and the API-key check.

The scheduler, the executor, the scheduler's side of the executor hop and the client
share this one implementation.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

log = logging.getLogger("nanoserve.security")

# Orchestrator probes carry no key, so health checks stay open; they reveal nothing but SERVING / NOT_SERVING.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)
PEM_MARKER = b"-----BEGIN "


def read_pem(path: str, what: str) -> bytes:
    """The file's bytes, or a ValueError that names the flag's file and what is wrong with it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the TLS {what} file {path!r}: {e.strerror}") from e
    if PEM_MARKER not in data:
        raise ValueError(f"the TLS {what} file {path!r} is not PEM (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class TLSConfig:
    """PEM file paths for one side of a TLS connection.

    A server needs ``cert_file`` and ``key_file``; a server given ``ca_file`` also
    requires client certificates signed by that CA (mutual TLS). A client uses
    ``ca_file`` to verify the server (the system roots when absent) and presents
    ``cert_file``/``key_file`` when the server asks for a client certificate.
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        """Fail at startup, naming the file, rather than at the first handshake with an opaque SSL error."""
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a TLS certificate and its private key go together: give both --tls-cert and --tls-key")
        for path, what in ((self.cert_file, "certificate"), (self.key_file, "private key"), (self.ca_file, "CA")):
            if path is not None:
                read_pem(path, what)

    @classmethod
    def from_flags(cls, cert_file: str | None, key_file: str | None, ca_file: str | None) -> TLSConfig | None:
        """None (plaintext) when no flag is set; empty strings count as unset, as an empty env variable does."""
        cert_file, key_file, ca_file = cert_file or None, key_file or None, ca_file or None
        if cert_file is None and key_file is None and ca_file is None:
            return None
        return cls(cert_file, key_file, ca_file)

    @property
    def require_client_auth(self) -> bool:
        """A server that trusts a CA demands a client certificate from it: mutual TLS."""
        return self.ca_file is not None

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(certificate chain, private key, CA roots) as PEM bytes; None for an unset file."""
        return (
            read_pem(self.cert_file, "certificate") if self.cert_file else None,
            read_pem(self.key_file, "private key") if self.key_file else None,
            read_pem(self.ca_file, "CA") if self.ca_file else None,
        )


def transport_name(tls: TLSConfig | None) -> str:
    """For the startup log line: what a server bound with ``tls`` speaks."""
    if tls is None:
        return "plaintext"
    return "mTLS" if tls.require_client_auth else "TLS"


def server_credentials(cfg: TLSConfig) -> grpc.ServerCredentials:
    """TLS with the server's certificate; mutual TLS when the config names a CA."""
    cert, key, ca = cfg.read()
    if cert is None or key is None:
        raise ValueError("a TLS server needs a certificate and a private key (--tls-cert, --tls-key)")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=cfg.require_client_auth)


def channel_credentials(cfg: TLSConfig) -> grpc.ChannelCredentials:
    """Verify the server with the CA (system roots if none); present the client certificate when one is set."""
    cert, key, ca = cfg.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host``; plaintext elsewhere earns a startup warning."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(server: grpc.Server | grpc.aio.Server, host: str, port: int, tls: TLSConfig | None = None) -> int:
    """Bind ``host:port`` (TLS when ``tls`` is set) on a sync or aio server; the bound port, or OSError."""
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, server_credentials(tls)) if tls else server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot bind {address}: {e}") from e
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    if tls is None and not is_loopback(host):
        log.warning("serving plaintext gRPC on non-loopback %s: anyone on the network can reach it; set --tls-*", host)
    return bound


def secure_or_insecure_channel(target: str, credentials: grpc.ChannelCredentials | None,
                               options: list[tuple[str, object]]) -> grpc.Channel:
    """A sync channel: TLS with ``credentials`` when given, plaintext otherwise."""
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def bearer_token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> bytes | None:
    """The token of the first ``authorization: Bearer <token>`` header, as bytes for a constant-time compare."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            return token.strip().encode() if scheme.lower() == "bearer" else None
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every RPC but health checks unless it carries ``authorization: Bearer <api key>``.

    A refused call is answered UNAUTHENTICATED before its request is even
    deserialized, so an unauthenticated peer reaches no servicer code.
    """

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key is empty; unset it to serve without one")
        self.api_key = api_key.encode()

    def authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return True
        token = bearer_token(details.invocation_metadata)
        return token is not None and hmac.compare_digest(token, self.api_key)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or self.authorized(details):
            return handler
        return refusal(handler, details.method)


def refusal(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same arity as ``handler`` that aborts with UNAUTHENTICATED and a message saying what to send."""
    message = (
        f"{method} needs an API key: send the metadata header 'authorization: Bearer <key>' "
        "(nanoserve CLI: --api-key)"
    )

    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)
