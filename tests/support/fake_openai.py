"""A small OpenAI-compatible chat server (FastAPI + uvicorn, server-sent events) for the load
generator's unit tests: streams `max_tokens` one-word chunks with set delays, ends with a usage
chunk and `[DONE]`, and records what it was sent. The user message steers it: "[[status 429]]"
answers 429, "[[error midway]]" sends an error event after two chunks, "[[hang]]" never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeServer:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    disconnects: int = 0
    base_url: str = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(request: Request) -> StreamingResponse | JSONResponse:
            body = await request.json()
            self.bodies.append(body)
            text = body["messages"][-1]["content"]
            if "[[status 429]]" in text:
                return JSONResponse({"error": {"message": "busy", "type": "rate_limit"}}, status_code=429)
            return StreamingResponse(self._stream(body, text), media_type="text/event-stream")

        return app

    async def _stream(self, body: dict[str, Any], text: str) -> AsyncIterator[str]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n = int(body["max_tokens"])
            base = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": body["model"],
            }

            def chunk(delta: dict[str, str], finish: str | None = None) -> str:
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                return "data: " + json.dumps({**base, "choices": [choice], "usage": None}) + "\n\n"

            yield chunk({"role": "assistant", "content": ""})
            await asyncio.sleep(3600 if "[[hang]]" in text else self.ttft_s)
            for i in range(n):
                if i == 2 and "[[error midway]]" in text:
                    yield (
                        "data: "
                        + json.dumps({"error": {"message": "worker lost", "type": "server_error"}})
                        + "\n\n"
                    )
                    return
                if i:
                    await asyncio.sleep(self.itl_s)
                yield chunk({"content": f" w{i}"}, "length" if i == n - 1 else None)
            usage = {
                "prompt_tokens": 42,
                "completion_tokens": n,
                "total_tokens": 42 + n,
                "prompt_tokens_details": {"cached_tokens": 16},
            }
            yield "data: " + json.dumps({**base, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        finally:
            self.in_flight -= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_fake_server(**kwargs: Any) -> Iterator[FakeServer]:
    fake = FakeServer(**kwargs)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake OpenAI server did not start")
        time.sleep(0.02)
    fake.base_url = f"http://127.0.0.1:{port}/v1"
    try:
        yield fake
    finally:
        server.should_exit = True
        thread.join(timeout=10)
