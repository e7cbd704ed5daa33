"""Decode frames (DecodeEvent) built from the engine's outputs: TOKENS and the one FINAL frame,
which carries the authoritative count and finish reason (ABORT when the request ended without
a terminal output)."""

from __future__ import annotations

import dataclasses

from services.worker.engine.api import RequestOutput
from services.worker.messages import DecodeEvent
from shared.cluster import DecodeFrameKind, FinishReason


def decode_event(
    request_id: str, kind: DecodeFrameKind, out: RequestOutput, return_token_ids: bool
) -> DecodeEvent:
    """A TOKENS or FINAL frame from an engine output (FINAL carries the count and reason)."""
    final = kind is DecodeFrameKind.FINAL
    return DecodeEvent(
        request_id=request_id,
        kind=kind,
        prompt_tokens=out.num_prompt_tokens,
        local_cached_tokens=out.num_local_cached_tokens,
        transferred_cached_tokens=out.num_transferred_tokens,
        text=out.text_delta,
        token_ids=out.new_token_ids if return_token_ids else (),
        generated_tokens=out.num_generated_tokens if final else None,
        finish_reason=(out.finish_reason or FinishReason.ABORT) if final else None,
        logprobs=out.new_logprobs,
        prompt_logprobs=out.prompt_logprobs,
    )


def final_event(
    request_id: str, last: RequestOutput | None, return_token_ids: bool, prompt_tokens: int
) -> DecodeEvent:
    """The one builder of the FINAL frame: from the terminal output, or (a handle that ended
    without one) an ABORT that keeps the last figures seen."""
    if last is not None and last.finished:
        return decode_event(request_id, DecodeFrameKind.FINAL, last, return_token_ids)
    if last is None:
        return DecodeEvent(
            request_id=request_id,
            kind=DecodeFrameKind.FINAL,
            prompt_tokens=prompt_tokens,
            local_cached_tokens=0,
            transferred_cached_tokens=0,
            generated_tokens=0,
            finish_reason=FinishReason.ABORT,
        )
    return dataclasses.replace(
        decode_event(request_id, DecodeFrameKind.FINAL, last, return_token_ids),
        text="",
        token_ids=(),
        logprobs=(),
        prompt_logprobs=(),
        finish_reason=FinishReason.ABORT,
    )
