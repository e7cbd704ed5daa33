"""TLS and mutual TLS over real loopback servers, with certificates made by openssl for the test."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.channels import ChannelCache, make_channel
from shared.server import Server
from shared.tls import TlsSettings
from tests.support.pki import make_pki

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _settings(d: Path, client_auth: bool) -> TlsSettings:
    return TlsSettings(
        tls_cert_file=str(d / "tls.crt"),
        tls_key_file=str(d / "tls.key"),
        tls_ca_file=str(d / "ca.crt"),
        tls_client_auth=client_auth,
        tls_server_name="pdserve.internal",
    )


async def _check(address: str, channel: grpc.aio.Channel) -> int:
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int((await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status)


@pytest.fixture(params=[False, True], ids=["tls", "mtls"])
async def tls_server(request: pytest.FixtureRequest, pki: Path) -> AsyncIterator[tuple[Server, TlsSettings]]:
    settings = _settings(pki, client_auth=request.param)
    server = Server("127.0.0.1:0", ["pdserve.v1.Gateway"], tls=settings.tls_config())
    await server.start()
    await server.set_serving(True)
    yield server, settings
    await server.stop(0)


async def test_tls_client_reaches_tls_server(tls_server: tuple[Server, TlsSettings]) -> None:
    server, settings = tls_server
    status = await _check(server.address, make_channel(server.address, settings.tls_config()))
    assert status == health_pb2.HealthCheckResponse.SERVING


async def test_plaintext_client_is_refused(tls_server: tuple[Server, TlsSettings]) -> None:
    server = tls_server[0]
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await _check(server.address, make_channel(server.address))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_clients_without_a_certificate(pki: Path) -> None:
    server_settings = _settings(pki, client_auth=True)
    server = Server("127.0.0.1:0", ["pdserve.v1.Gateway"], tls=server_settings.tls_config())
    await server.start()
    try:
        one_way = _settings(pki, client_auth=False).tls_config()
        with pytest.raises(grpc.aio.AioRpcError):
            await _check(server.address, make_channel(server.address, one_way))
    finally:
        await server.stop(0)


def test_half_configured_tls_is_an_error(pki: Path) -> None:
    with pytest.raises(ValueError, match="both"):
        TlsSettings(tls_cert_file=str(pki / "tls.crt")).tls_config()
    with pytest.raises(ValueError, match="cannot read"):
        TlsSettings(tls_cert_file="/nonexistent.crt", tls_key_file="/nonexistent.key").tls_config()
    assert TlsSettings().tls_config() is None


async def test_channel_cache_dials_with_the_tls_it_is_given(tls_server: tuple[Server, TlsSettings]) -> None:
    server, settings = tls_server
    secure, plain = ChannelCache(tls=settings.tls_config()), ChannelCache(tls=None)
    try:
        stub = health_pb2_grpc.HealthStub(secure.get(server.address))
        resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):  # no process-wide TLS default to fall back on
            await health_pb2_grpc.HealthStub(plain.get(server.address)).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
    finally:
        await secure.close()
        await plain.close()
