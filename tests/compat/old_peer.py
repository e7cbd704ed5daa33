"""An "old" (v1.0) pdserve peer, run as a subprocess by the version-skew tests.

v1.0 and current stubs both define the proto package pdserve.v1, so they cannot share one process.
This program imports only stubs generated from compat/v1.0 (directory given as argv[2]).

  old_peer.py worker STUBS          scripted v1.0 worker on 127.0.0.1:0; prints "PORT <n>"
  old_peer.py parse STUBS           reads {"Name": hex bytes} JSON on stdin, parses each with the
                                    v1.0 class, prints the known fields and the re-serialized bytes
  old_peer.py client STUBS ADDRESS  calls Prefill and Decode on a (new) worker like a v1.0 gateway
                                    would, prints what it understood

The scripted worker never sets generated_tokens (v1.0 has no such field). Its behaviour is chosen
by the request_id's prefix, so one process serves every scenario:
  stop-*     2 TOKENS frames, then FINAL stop
  length-*   TOKENS frames up to max_tokens, then FINAL length
  overrun-*  a buggy worker: max_tokens + 5 TOKENS frames, then FINAL stop
  bytes-*    byte fallback: 4 TOKENS frames with empty text, one with an emoji, then FINAL stop
  ids-*      TOKENS frames carrying 2 token ids each (return_token_ids), then FINAL stop
  eos-*      the prefill reply is an immediate EOS (no text, stop)
  push-*     waits for the request's KV over PushKv (a v1.0 worker knows only the gRPC push), then
             one TOKENS frame "kv<bytes>/<chunks>" of what arrived, then FINAL stop
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any


def _import_stubs(stubs: str) -> tuple[Any, Any, Any]:
    sys.path.insert(0, stubs)
    from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    return common_pb2, worker_pb2, worker_pb2_grpc


async def run_worker(stubs: str) -> None:
    import grpc

    common_pb2, worker_pb2, worker_pb2_grpc = _import_stubs(stubs)

    def tokens(rid: str, text: str, ids: tuple[int, ...] = ()) -> Any:
        return worker_pb2.DecodeFrame(
            request_id=rid, kind=worker_pb2.DECODE_FRAME_KIND_TOKENS, text=text, token_ids=ids
        )

    servicer_base: Any = worker_pb2_grpc.WorkerServicer  # imported at run time from old stubs
    pushed: dict[str, tuple[int, int]] = {}  # ticket -> (bytes, chunks) of a finished push
    push_done: dict[str, asyncio.Event] = {}

    class OldWorker(servicer_base):
        async def PushKv(self, request_iterator: Any, context: Any) -> Any:
            size = chunks = 0
            ticket = ""
            async for chunk in request_iterator:
                ticket = chunk.transfer_ticket
                size += len(chunk.data)
                chunks += 1
            pushed[ticket] = (size, chunks)
            push_done.setdefault(ticket, asyncio.Event()).set()
            return worker_pb2.PushKvResponse(bytes_received=size)

        async def Decode(self, request: Any, context: Any) -> AsyncIterator[Any]:
            rid, max_tokens = request.request_id, request.sampling.max_tokens
            scenario = rid.split("-", 1)[0]
            ticket = f"old-ticket-{rid}"
            yield worker_pb2.DecodeFrame(
                request_id=rid, kind=worker_pb2.DECODE_FRAME_KIND_ADMITTED, transfer_ticket=ticket
            )
            already = 0 if request.local_prefill else 1  # the prefill worker sampled the first token
            reason = common_pb2.FINISH_REASON_STOP
            if scenario == "stop":
                for _ in range(2):
                    yield tokens(rid, "s")
            elif scenario == "length":
                for _ in range(max_tokens - already):
                    yield tokens(rid, "l")
                reason = common_pb2.FINISH_REASON_LENGTH
            elif scenario == "overrun":
                for _ in range(max_tokens + 5):
                    yield tokens(rid, "o")
            elif scenario == "bytes":
                for _ in range(4):
                    yield tokens(rid, "")
                yield tokens(rid, "\U0001f642")
            elif scenario == "ids":
                for i in range(3):
                    yield tokens(rid, "ii", (10 + i, 20 + i) if request.return_token_ids else ())
            elif scenario == "push":
                await asyncio.wait_for(push_done.setdefault(ticket, asyncio.Event()).wait(), 30)
                size, chunks = pushed[ticket]
                yield tokens(rid, f"kv{size}/{chunks}")
            yield worker_pb2.DecodeFrame(
                request_id=rid, kind=worker_pb2.DECODE_FRAME_KIND_FINAL, finish_reason=reason
            )

        async def Prefill(self, request: Any, context: Any) -> Any:
            rid = request.request_id
            if rid.startswith("eos-"):
                return worker_pb2.PrefillResponse(request_id=rid, finish_reason=common_pb2.FINISH_REASON_STOP)
            return worker_pb2.PrefillResponse(
                request_id=rid, text="p", prompt_tokens=len(request.prompt_token_ids)
            )

        async def Abort(self, request: Any, context: Any) -> Any:
            return worker_pb2.AbortResponse(found=True)

    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(OldWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await server.wait_for_termination()


def parse(stubs: str) -> None:
    from google.protobuf.json_format import MessageToDict

    _, worker_pb2, _ = _import_stubs(stubs)
    out = {}
    for name, hexdata in json.loads(sys.stdin.read()).items():
        msg = getattr(worker_pb2, name)()
        msg.ParseFromString(bytes.fromhex(hexdata))
        out[name] = {
            "fields": MessageToDict(msg, preserving_proto_field_name=True),
            "knows_generated_tokens": "generated_tokens" in msg.DESCRIPTOR.fields_by_name,
            "reserialized": msg.SerializeToString().hex(),
        }
    print(json.dumps(out))


async def client(stubs: str, address: str) -> None:
    import grpc
    from google.protobuf.json_format import MessageToDict

    _, worker_pb2, worker_pb2_grpc = _import_stubs(stubs)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        prefill = await stub.Prefill(
            worker_pb2.PrefillRequest(request_id="old-gw", prompt_token_ids=[1, 2]), timeout=10
        )
        frames = [
            f
            async for f in stub.Decode(
                worker_pb2.DecodeRequest(request_id="old-gw", prompt_token_ids=[1, 2], local_prefill=True),
                timeout=10,
            )
        ]
    print(
        json.dumps(
            {
                "prefill": MessageToDict(prefill, preserving_proto_field_name=True),
                "frames": [MessageToDict(f, preserving_proto_field_name=True) for f in frames],
            }
        )
    )


def main() -> None:
    command, stubs = sys.argv[1], sys.argv[2]
    if command == "worker":
        asyncio.run(run_worker(stubs))
    elif command == "parse":
        parse(stubs)
    elif command == "client":
        asyncio.run(client(stubs, sys.argv[3]))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
