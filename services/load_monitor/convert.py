"""Protobuf <-> domain conversion for the load-monitor's own messages (the cluster types it shares
with every service convert in shared.cluster_convert)."""

from __future__ import annotations

from services.load_monitor.monitor import LoadReport, Registration
from shared.cluster_convert import rank_load_from_pb
from shared.proto import load_monitor_pb2, worker_pb2


def load_report_from_pb(pb: worker_pb2.GetLoadResponse) -> LoadReport:
    return LoadReport(worker_id=pb.worker_id, ranks=[rank_load_from_pb(r) for r in pb.ranks])


def registration_to_pb(reg: Registration) -> load_monitor_pb2.RegisterResponse:
    return load_monitor_pb2.RegisterResponse(
        worker_id=reg.worker_id,
        lease_ttl_ms=reg.lease_ttl_ms,
        heartbeat_interval_ms=reg.heartbeat_interval_ms,
    )
