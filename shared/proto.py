"""The generated protobuf and gRPC modules, imported from one place (run `make gen` first)."""

from shared.gen.pdserve.v1 import (  # noqa: F401
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    load_monitor_pb2,
    load_monitor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
