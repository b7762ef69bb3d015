"""TLS, mutual TLS and the API key, with throwaway certificates made by the openssl CLI."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.security import (
    ApiKeyInterceptor,
    TLSConfig,
    bearer_token,
    bind,
    channel_credentials,
    is_loopback,
)
from executor_svc.fakes.shadow import ShadowExecutor
from executor_svc.service import build_server
from nanoserve.v1 import generation_pb2 as gen_pb
from nanoserve.v1 import generation_pb2_grpc as gen_grpc
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.executor_client import RemoteExecutor

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

HOST = "127.0.0.1"
API_KEY = "s3cret-key"
SHADOW = dict(num_blocks=32, block_size=4, vocab_size=50, eos_token_ids=(0,))
PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10, 11], [3]]


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    other_client_cert: str
    other_client_key: str


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key, "-out", cert, "-days", "1", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def make_leaf(folder: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[str, str]:
    """A certificate for ``name`` signed by ``ca``, with the given X.509 v3 extensions."""
    cert, key, csr, ext = (folder / f"{name}{suffix}" for suffix in (".pem", ".key", ".csr", ".ext"))
    ext.write_text(extensions)
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-set_serial", "0x" + name.encode().hex(),
            "-days", "1", "-out", cert, "-extfile", ext)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    folder = tmp_path_factory.mktemp("certs")
    ca, other_ca = make_ca(folder, "ca"), make_ca(folder, "other-ca")
    server_ext = "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    client_ext = "extendedKeyUsage=clientAuth\n"
    return Certs(
        str(ca[0]), *make_leaf(folder, "server", ca, server_ext), *make_leaf(folder, "client", ca, client_ext),
        str(other_ca[0]), *make_leaf(folder, "intruder", other_ca, client_ext),
    )


@contextlib.contextmanager
def executor_server(tls: TLSConfig | None) -> Iterator[str]:
    server, port = build_server(ShadowExecutor(**SHADOW), HOST, 0, tls)
    server.start()
    try:
        yield f"{HOST}:{port}"
    finally:
        server.stop(None)


def generate(executor: ShadowExecutor | RemoteExecutor) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    return [c.token_ids for c in Engine(executor, SchedulerConfig(8, 16)).generate(PROMPTS, params)]


def test_executor_over_mtls_generates_the_plain_tokens(certs: Certs) -> None:
    client = channel_credentials(TLSConfig(certs.client_cert, certs.client_key, certs.ca))
    with executor_server(TLSConfig(certs.server_cert, certs.server_key, certs.ca)) as target:
        remote = RemoteExecutor(target, step_timeout_s=10, credentials=client)
        try:
            assert generate(remote) == generate(ShadowExecutor(**SHADOW))
        finally:
            remote.close()


@pytest.mark.parametrize("client", ["plaintext", "no client cert", "cert from another CA", "server CA not trusted"])
def test_mtls_executor_refuses_unauthenticated_clients(certs: Certs, client: str) -> None:
    credentials = {
        "plaintext": None,
        "no client cert": TLSConfig(ca_file=certs.ca),
        "cert from another CA": TLSConfig(certs.other_client_cert, certs.other_client_key, certs.ca),
        "server CA not trusted": TLSConfig(certs.client_cert, certs.client_key, certs.other_ca),
    }[client]
    with executor_server(TLSConfig(certs.server_cert, certs.server_key, certs.ca)) as target:
        remote = RemoteExecutor(target, credentials=credentials and channel_credentials(credentials))
        try:
            with pytest.raises(grpc.RpcError) as refused:
                remote.get_info(timeout_s=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            remote.close()


def test_tls_config_names_the_bad_file(certs: Certs, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="CA file .*missing.pem"):
        TLSConfig(certs.server_cert, certs.server_key, missing)
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82")
    with pytest.raises(ValueError, match="certificate file .*cert.der.* not PEM"):
        TLSConfig(str(not_pem), certs.server_key)
    with pytest.raises(ValueError, match="--tls-key"):
        TLSConfig(cert_file=certs.server_cert)


def test_tls_config_from_flags(certs: Certs) -> None:
    assert TLSConfig.from_flags(None, "", None) is None
    server = TLSConfig.from_flags(certs.server_cert, certs.server_key, "")
    assert server is not None and not server.require_client_auth
    assert TLSConfig.from_flags(certs.server_cert, certs.server_key, certs.ca).require_client_auth


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                                ("[::1]", True), ("0.0.0.0", False), ("executor", False)])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


class FakeGeneration(gen_grpc.GenerationServicer):
    """Answers the unary and the streaming RPC, so an authorized call visibly gets through."""

    async def GetModelInfo(self, request: gen_pb.GetModelInfoRequest, context) -> gen_pb.ModelInfo:
        return gen_pb.ModelInfo(model_id="fake")

    async def Generate(self, request: gen_pb.GenerateRequest, context) -> AsyncIterator[gen_pb.GenerateResponse]:
        for token in (1, 2):
            yield gen_pb.GenerateResponse(token_ids=[token])


@contextlib.asynccontextmanager
async def aio_server(tls: TLSConfig | None = None, api_key: str | None = None) -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(api_key)] if api_key else None)
    gen_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = bind(server, HOST, 0, tls)
    await server.start()
    try:
        yield f"{HOST}:{port}"
    finally:
        await server.stop(None)


async def health_status(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


def test_aio_server_over_tls(certs: Certs) -> None:
    async def run() -> None:
        async with aio_server(TLSConfig(certs.server_cert, certs.server_key)) as target:
            credentials = channel_credentials(TLSConfig(ca_file=certs.ca))
            async with grpc.aio.secure_channel(target, credentials) as channel:
                assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
            async with grpc.aio.insecure_channel(target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await health_status(channel)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {API_KEY}", f"Bearer {API_KEY}x"])
def test_api_key_refuses_unary_and_streaming_calls(authorization: str | None) -> None:
    metadata = (("authorization", authorization),) if authorization else None

    async def run() -> None:
        async with aio_server(api_key=API_KEY) as target, grpc.aio.insecure_channel(target) as channel:
            stub = gen_grpc.GenerationStub(channel)
            calls = {
                "unary": lambda: stub.GetModelInfo(gen_pb.GetModelInfoRequest(), metadata=metadata, timeout=5),
                "streaming": lambda: stub.Generate(gen_pb.GenerateRequest(), metadata=metadata, timeout=5).read(),
            }
            for kind, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, kind
                assert "authorization: Bearer <key>" in refused.value.details(), kind

    asyncio.run(run())


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_api_key_lets_the_right_key_and_health_checks_through(scheme: str) -> None:
    metadata = (("authorization", f"{scheme} {API_KEY}"),)

    async def run() -> None:
        async with aio_server(api_key=API_KEY) as target, grpc.aio.insecure_channel(target) as channel:
            stub = gen_grpc.GenerationStub(channel)
            info = await stub.GetModelInfo(gen_pb.GetModelInfoRequest(), metadata=metadata, timeout=5)
            assert info.model_id == "fake"
            stream = stub.Generate(gen_pb.GenerateRequest(), metadata=metadata, timeout=5)
            assert [list(r.token_ids) async for r in stream] == [[1], [2]]
            assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(run())


def test_api_key_must_not_be_empty() -> None:
    with pytest.raises(ValueError, match="empty"):
        ApiKeyInterceptor("")


def test_bearer_token_parsing() -> None:
    assert bearer_token((("x-other", "1"), ("authorization", "Bearer  abc "))) == b"abc"
    assert bearer_token((("authorization", b"Bearer abc"),)) == b"abc"
    assert bearer_token((("authorization", "Basic abc"),)) is None
    assert bearer_token(None) is None
