"""The worker engine: continuous batching over a paged KV cache (see api.py for the contract).

`create_engine(config)` builds an engine; call `start()` before adding requests.
"""

from __future__ import annotations

from services.worker.engine.api import Engine, EngineConfig


def create_engine(config: EngineConfig) -> Engine:
    from services.worker.engine.engine import PagedEngine

    return PagedEngine(config)


__all__ = ["create_engine"]
