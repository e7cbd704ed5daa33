"""What a request's handle receives: the RequestOutput built from a Request's state (new tokens
and text since the last output, the authoritative counts), and the per-step list of outputs a
rank delivers once it leaves its lock."""

from __future__ import annotations

from services.worker.engine.api import RequestOutput
from services.worker.engine.handle import OutputHandle
from services.worker.engine.request import Request

# outputs of one locked phase, delivered together after it (handle.deliver_batch)
Outputs = list[tuple[OutputHandle, RequestOutput]]


def request_output(req: Request, finished: bool, drafts: list[int] | None = None) -> RequestOutput:
    """What changed for `req` since its last output (advances its delivery cursor)."""
    first = req.num_prompt_tokens + req.num_handoff_tokens + req.num_reported_tokens
    new_ids = tuple(req.token_ids[first:])
    new_logprobs = tuple(
        req.output_logprobs[req.num_reported_tokens : req.num_reported_tokens + len(new_ids)]
    )
    req.num_reported_tokens += len(new_ids)
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=new_ids,
        # a PREFILL_ONLY handoff (finished here, no reason) is not the end of the text: keep
        # back what may start a stop string; the decode worker replays the same state
        text_delta=req.text.take(final=finished and req.finish_reason is not None),
        finished=finished,
        finish_reason=req.finish_reason if finished else None,
        num_generated_tokens=req.num_generated_tokens,
        num_prompt_tokens=req.num_prompt_tokens,
        num_local_cached_tokens=req.num_local_cached_tokens,
        num_transferred_tokens=req.num_transferred_tokens,
        num_prefill_chunks=req.num_prefill_chunks,
        prefill_ns=req.prefill_ns,
        draft_token_ids=tuple(drafts or ()),
        new_logprobs=new_logprobs,
        prompt_logprobs=req.take_prompt_logprobs(),
        num_computed_tokens=req.num_computed_tokens,
    )
