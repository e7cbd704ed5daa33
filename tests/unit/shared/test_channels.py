"""shared.channels: one channel per address (bounded when asked), closed together; per-call
metadata reaches the server on every kind of call, read afresh for each call."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from shared.channels import ChannelCache, make_channel

KEY = "x-pdserve-test-token"


def _token(context: grpc.aio.ServicerContext) -> bytes:
    values = [v for k, v in context.invocation_metadata() or () if k == KEY]
    return ",".join(str(v) for v in values).encode()


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return _token(context)


async def _unary_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield _token(context)
    yield b"end"


async def _stream_unary(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    async for _ in requests:
        pass
    return _token(context)


async def _stream_stream(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for _ in requests:
        yield _token(context)


@pytest.fixture
async def echo_address() -> AsyncIterator[str]:
    """A server whose methods answer with the KEY metadata they received (bytes in, bytes out)."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Echo",
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(_unary),
                    "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
                    "StreamUnary": grpc.stream_unary_rpc_method_handler(_stream_unary),
                    "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream),
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def _requests() -> AsyncIterator[bytes]:
    yield b"a"


async def _all_kinds(channel: grpc.aio.Channel) -> list[bytes]:
    """What the server saw for one call of each kind."""
    unary = await channel.unary_unary("/test.Echo/Unary")(b"", timeout=5)
    frames = [f async for f in channel.unary_stream("/test.Echo/UnaryStream")(b"", timeout=5)]
    client_stream = await channel.stream_unary("/test.Echo/StreamUnary")(_requests(), timeout=5)
    bidi = [f async for f in channel.stream_stream("/test.Echo/StreamStream")(_requests(), timeout=5)]
    assert frames[1] == b"end"
    return [unary, frames[0], client_stream, bidi[0]]


async def test_call_metadata_reaches_every_kind_of_call(echo_address: str) -> None:
    tokens: Iterator[str] = iter(f"t{i}" for i in range(100))
    cache = ChannelCache(tls=None, call_metadata=lambda: [(KEY, next(tokens))])
    try:
        seen = await _all_kinds(cache.get(echo_address))
    finally:
        await cache.close()
    assert seen == [b"t0", b"t1", b"t2", b"t3"]  # one fresh value per call (a rotated token)


async def test_call_metadata_comes_after_what_the_caller_set(echo_address: str) -> None:
    async with make_channel(echo_address, call_metadata=lambda: [(KEY, "kit")]) as channel:
        seen = await channel.unary_unary("/test.Echo/Unary")(b"", metadata=[(KEY, "caller")], timeout=5)
    assert seen == b"caller,kit"


async def test_without_call_metadata_nothing_is_added(echo_address: str) -> None:
    cache = ChannelCache(tls=None)
    try:
        seen = await _all_kinds(cache.get(echo_address))
    finally:
        await cache.close()
    assert seen == [b"", b"", b"", b""]


async def test_one_channel_per_address_until_forgotten() -> None:
    cache = ChannelCache(tls=None)
    first = cache.get("127.0.0.1:1")
    assert cache.get("127.0.0.1:1") is first
    assert cache.get("127.0.0.1:2") is not first
    await cache.forget("127.0.0.1:1")
    await cache.forget("127.0.0.1:9")  # unknown: nothing to do
    assert "127.0.0.1:1" not in cache and len(cache) == 1
    assert cache.get("127.0.0.1:1") is not first  # a new one after forget
    await cache.close()
    assert len(cache) == 0


async def test_bounded_cache_drops_the_least_recently_used() -> None:
    cache = ChannelCache(tls=None, max_channels=3, evict_grace_s=0.1)
    a = cache.get("127.0.0.1:1")
    cache.get("127.0.0.1:2")
    cache.get("127.0.0.1:3")
    assert cache.get("127.0.0.1:1") is a  # used again: now the most recent
    cache.get("127.0.0.1:4")
    assert len(cache) == 3
    assert "127.0.0.1:2" not in cache  # least recently used went first
    assert "127.0.0.1:1" in cache
    await cache.close()  # also waits for the evicted channel's close
    assert len(cache) == 0


def test_max_channels_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_channels"):
        ChannelCache(tls=None, max_channels=0)
