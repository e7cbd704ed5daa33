"""NIXL in tests: the READ target's agent progressed on a thread while a READ runs (the agents
run without NIXL's own busy-polling thread; a worker's NixlKvSender does this in production)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from services.worker.kv_nixl import NixlKvAgent


@contextlib.contextmanager
def progressed(agent: NixlKvAgent) -> Iterator[None]:
    """`agent.progress()` about every millisecond until the block ends."""
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            agent.progress()
            time.sleep(0.001)

    server = threading.Thread(target=serve)
    server.start()
    try:
        yield
    finally:
        done.set()
        server.join()
