"""Request metrics, recorded once per request when it ends (from the request state)."""

from __future__ import annotations

from services.gateway.request import RequestState, RequestStatus
from shared import metrics


def record_finished(state: RequestState) -> None:
    """TTFT / inter-token / e2e latencies, token counters and cache hits of a finished request.
    Counters only ever get non-negative increments (the figures are clamped by construction)."""
    ttft = state.ttft_s
    if ttft is not None:
        metrics.TTFT_SECONDS.observe(ttft)
        for phase, seconds in state.ttft_phases_s.items():
            metrics.TTFT_PHASE_SECONDS.labels(phase=phase).observe(seconds)
    for gap in state.inter_frame_s:
        metrics.INTER_TOKEN_SECONDS.observe(gap)
    if state.frame_times_s:
        metrics.E2E_SECONDS.observe(state.frame_times_s[-1] - state.arrival_s)
    if state.status is RequestStatus.FAILED or not state.status.is_finished:
        return
    usage = state.usage
    metrics.PROMPT_TOKENS.labels(model=state.model).inc(usage.prompt_tokens)
    metrics.GENERATION_TOKENS.labels(model=state.model).inc(usage.completion_tokens)
    metrics.REQUESTS.labels(finish_reason=state.finish_reason.value, model=state.model).inc()
    metrics.PREFIX_CACHE_HITS.labels(source="local").inc(usage.cache.local_tokens)
    metrics.PREFIX_CACHE_HITS.labels(source="transferred").inc(usage.cache.transferred_tokens)


def record_error(code_name: str) -> None:
    metrics.ERRORS.labels(code=code_name).inc()
