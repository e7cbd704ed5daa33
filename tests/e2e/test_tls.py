"""The whole stack over TLS (`pdserve up --tls-*`): every hop encrypted, plaintext refused."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import grpc
import httpx
import pytest

from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.support.pki import SERVER_NAME, make_pki
from tests.support.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")]


async def test_stack_over_tls(tiny_bpe_model: Path, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    up_args = [
        "--tls-cert-file",
        str(pki / "tls.crt"),
        "--tls-key-file",
        str(pki / "tls.key"),
        "--tls-ca-file",
        str(pki / "ca.crt"),
        "--tls-server-name",
        SERVER_NAME,
    ]
    with running_stack(str(tiny_bpe_model), tmp_path / "logs", up_args=up_args) as stack:
        creds = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())
        options = [("grpc.ssl_target_name_override", SERVER_NAME)]
        async with grpc.aio.secure_channel(stack.gateway, creds, options=options) as channel:
            req = gateway_pb2.GenerateRequest(prompt="Hello over TLS", max_tokens=6, temperature=0)
            frames = [f async for f in gateway_pb2_grpc.GatewayStub(channel).Generate(req, timeout=60)]
        assert frames[-1].kind == gateway_pb2.FRAME_KIND_FINAL
        assert frames[-1].usage.completion_tokens >= 1
        async with grpc.aio.insecure_channel(stack.gateway) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await gateway_pb2_grpc.GatewayStub(plain).Complete(req, timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert any("-cacert" in line for line in stack.output)  # the printed grpcurl line uses TLS
        # the HTTP API is HTTPS with the same certificate (checked against the CA; the certificate
        # names SERVER_NAME, not 127.0.0.1, hence no host name check); plain HTTP is refused
        https = stack.http_base_url.replace("http://", "https://")
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.check_hostname = False
        async with httpx.AsyncClient(verify=context, timeout=60) as client:
            r = await client.post(https + "/completions", json={"prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        async with httpx.AsyncClient(timeout=10) as client:
            with pytest.raises(httpx.HTTPError):
                await client.get(stack.http_base_url + "/models")
