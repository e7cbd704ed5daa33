"""The KV push client's channel cache."""

from __future__ import annotations

from services.worker import kv_transfer


async def test_push_client_caches_a_bounded_number_of_channels() -> None:
    pusher = kv_transfer.GrpcKvPusher()
    first = pusher._stub("127.0.0.1:1")
    assert pusher._stub("127.0.0.1:1") is first  # cached
    for port in range(2, kv_transfer._MAX_CACHED_CHANNELS + 2):
        pusher._stub(f"127.0.0.1:{port}")
    assert len(pusher._channels) == kv_transfer._MAX_CACHED_CHANNELS
    assert "127.0.0.1:1" not in pusher._channels  # least recently used went first
    await pusher.close()
    assert not pusher._channels
