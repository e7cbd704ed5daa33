"""`pdserve generate TEXT`: stream a chat completion from a running gateway to the terminal."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pdserve generate")
    p.add_argument("text", help="the user message (or the raw prompt with --raw)")
    p.add_argument("--address", default="127.0.0.1:50051", help="gateway host:port")
    p.add_argument("--raw", action="store_true", help="send as a raw prompt, without the chat template")
    p.add_argument("--system", default="", help="optional system message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument(
        "--api-key",
        default="",
        help="API key, sent as 'authorization: Bearer <key>' (when the gateway has keys)",
    )
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))

    from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc

    req = gateway_pb2.GenerateRequest(max_tokens=a.max_tokens, temperature=a.temperature)
    if a.top_p is not None:
        req.top_p = a.top_p
    if a.seed is not None:
        req.seed = a.seed
    if a.raw:
        req.prompt = a.text
    else:
        if a.system:
            req.messages.add(role="system", content=a.system)
        req.messages.add(role="user", content=a.text)
    with grpc.insecure_channel(a.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            metadata = [("authorization", f"Bearer {a.api_key}")] if a.api_key else None
            for frame in stub.Generate(req, timeout=a.timeout_s, metadata=metadata):
                sys.stdout.write(frame.text)
                sys.stdout.flush()
                if frame.HasField("usage"):
                    reason = common_pb2.FinishReason.Name(frame.finish_reason)
                    u = frame.usage
                    print(
                        f"\n[{frame.request_id}] finish={reason} prompt_tokens={u.prompt_tokens} "
                        f"completion_tokens={u.completion_tokens} cached_tokens={u.cached_tokens}",
                        file=sys.stderr,
                    )
        except grpc.RpcError as exc:
            print(f"\npdserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            raise SystemExit(1) from exc
