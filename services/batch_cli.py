"""`pdserve run-batch -i requests.jsonl -o results.jsonl`: run an OpenAI batch file through a
running gateway's Batch API (vLLM's `run-batch` file format: one `{"custom_id", "method",
"url", "body"}` per line) and write every request's result line (OpenAI's batch output shape) in
the input's order. Progress goes to stderr; Ctrl-C cancels the batch on the gateway.

Exit status: 0 when the batch completed (some requests may have failed: their lines carry the
error), 1 when it failed its input check, expired or was cancelled, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

ENDED = ("completed", "failed", "expired", "cancelled")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pdserve run-batch", description=__doc__.split("\n\n")[0])
    p.add_argument("-i", "--input", required=True, help="the batch file (JSONL, one request per line)")
    p.add_argument("-o", "--output", required=True, help="where every request's result line goes")
    p.add_argument("--url", default="http://127.0.0.1:50091", help="the gateway's HTTP base URL")
    p.add_argument("--api-key", default="", help="API key, when the gateway has keys")
    p.add_argument("--poll-s", type=float, default=1.0, help="how often progress is asked for (s)")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    data = Path(a.input).read_bytes()
    endpoint = _endpoint(data)
    if endpoint is None:
        raise SystemExit(f"pdserve run-batch: {a.input} has no request line with a url")
    headers = {"authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    with httpx.Client(base_url=a.url.rstrip("/"), headers=headers, timeout=60) as client:
        batch = _start(client, Path(a.input).name, data, endpoint)
        print(f"batch {batch['id']}: {endpoint}, {a.input}", file=sys.stderr)
        try:
            batch = _wait(client, batch["id"], a.poll_s)
        except KeyboardInterrupt:
            print("\ncancelling ...", file=sys.stderr)
            _call(client.post(f"/v1/batches/{batch['id']}/cancel"))
            batch = _wait(client, batch["id"], a.poll_s)
        lines = _results(client, batch)
    order = {cid: i for i, cid in enumerate(_custom_ids(data))}
    lines.sort(key=lambda line: order.get(str(line.get("custom_id")), len(order)))
    Path(a.output).write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    counts = batch.get("request_counts") or {}
    print(
        f"batch {batch['id']} {batch['status']}: {counts.get('completed', 0)} completed, "
        f"{counts.get('failed', 0)} failed of {counts.get('total', 0)}; results in {a.output}",
        file=sys.stderr,
    )
    for error in (batch.get("errors") or {}).get("data") or ():
        print(f"  line {error.get('line')}: {error.get('code')}: {error.get('message')}", file=sys.stderr)
    if batch["status"] != "completed":
        raise SystemExit(1)


def _requests(data: bytes) -> Iterator[dict[str, Any]]:
    """The batch file's JSON object lines (the gateway checks them; these only name things)."""
    for raw in data.splitlines():
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        if isinstance(value, dict):
            yield value


def _endpoint(data: bytes) -> str | None:
    """The url of the first request line (the batch's endpoint; the gateway checks the rest)."""
    return next((str(r["url"]) for r in _requests(data) if isinstance(r.get("url"), str)), None)


def _custom_ids(data: bytes) -> list[str]:
    return [str(r["custom_id"]) for r in _requests(data) if isinstance(r.get("custom_id"), str)]


def _call(response: httpx.Response) -> Any:
    """The JSON of a 2xx answer; otherwise exit with the gateway's error message."""
    if response.is_success:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    where = f"{response.request.method} {response.request.url.path}"
    raise SystemExit(f"pdserve run-batch: {where}: HTTP {response.status_code}: {message}")


def _start(client: httpx.Client, name: str, data: bytes, endpoint: str) -> dict[str, Any]:
    upload = _call(client.post("/v1/files", files={"file": (name, data)}, data={"purpose": "batch"}))
    body = {"input_file_id": upload["id"], "endpoint": endpoint, "completion_window": "24h"}
    return dict(_call(client.post("/v1/batches", json=body)))


def _wait(client: httpx.Client, batch_id: str, poll_s: float) -> dict[str, Any]:
    shown = ""
    while True:
        batch = dict(_call(client.get(f"/v1/batches/{batch_id}")))
        counts = batch.get("request_counts") or {}
        line = (
            f"{batch['status']}: {counts.get('completed', 0)} completed, {counts.get('failed', 0)} "
            f"failed of {counts.get('total', 0)}"
        )
        if line != shown:
            print(line, file=sys.stderr)
            shown = line
        if batch["status"] in ENDED:
            return batch
        time.sleep(poll_s)


def _results(client: httpx.Client, batch: dict[str, Any]) -> list[dict[str, Any]]:
    lines = []
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            text = client.get(f"/v1/files/{batch[key]}/content")
            lines += [json.loads(raw) for raw in _call_text(text).splitlines() if raw.strip()]
    return lines


def _call_text(response: httpx.Response) -> str:
    if not response.is_success:
        _call(response)
    return response.text
