"""StructuredOutput <-> its protobuf message (common.proto), for the gateway and the workers."""

from __future__ import annotations

from shared.errors import InvalidArgument
from shared.proto import common_pb2
from shared.structured_output import InvalidStructuredOutput, StructuredOutput, from_fields


def structured_from_pb(pb: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """None when no field is set. Raises InvalidArgument when several are."""
    try:
        return from_fields(pb.json_schema, pb.json_object, pb.regex, tuple(pb.choice), pb.grammar)
    except InvalidStructuredOutput as exc:
        raise InvalidArgument(f"structured: {exc}") from None


def structured_to_pb(s: StructuredOutput) -> common_pb2.StructuredOutput:
    if s.kind == "json_schema":
        return common_pb2.StructuredOutput(json_schema=s.spec)
    if s.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if s.kind == "regex":
        return common_pb2.StructuredOutput(regex=s.spec)
    if s.kind == "grammar":
        return common_pb2.StructuredOutput(grammar=s.spec)
    return common_pb2.StructuredOutput(choice=s.choices)
