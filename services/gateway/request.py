"""One request as the gateway sees it once it runs: its status (an enum whose order means
something, the allowed transitions), the frames and completion it answers with, and the request
state that owns everything relayed so far (text pieces, token ids, counts) with derived figures.
What a request is made of (the client's input, the validated sampling) is `inputs.py`."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from services.gateway import accounting
from services.gateway.accounting import CacheStats, FrameSource, Segment, Usage, WorkerCount
from services.gateway.inputs import TokenLogprob
from shared.cluster import FinishReason


class RequestStatus(enum.IntEnum):
    """Life of a request in the gateway. Order means something: everything >= FINISHED_STOPPED is
    finished. Back to WAITING: a retry before any output reached the client, or a migration after
    its decode worker failed mid-stream (the request then continues on other workers)."""

    WAITING = 0  # validated and tokenized, not (or no longer) scheduled
    SCHEDULED = 1  # workers chosen
    ADMITTED = 2  # decode worker admitted it and reserved KV (disaggregated)
    PREFILLING = 3  # prefill worker (or the unified worker) runs the prompt
    DECODING = 4  # first output sent to the client; relaying decode frames
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FAILED = 8  # ended with an error status

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FAILED,
}

ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.SCHEDULED} | _FINISHED),
    RequestStatus.SCHEDULED: frozenset(
        {RequestStatus.ADMITTED, RequestStatus.PREFILLING, RequestStatus.WAITING} | _FINISHED
    ),
    RequestStatus.ADMITTED: frozenset({RequestStatus.PREFILLING, RequestStatus.WAITING} | _FINISHED),
    RequestStatus.PREFILLING: frozenset({RequestStatus.DECODING, RequestStatus.WAITING} | _FINISHED),
    RequestStatus.DECODING: frozenset({RequestStatus.WAITING} | _FINISHED),  # WAITING: migration
    **{s: frozenset() for s in _FINISHED},
}

STATUS_BY_FINISH_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
}


class InvalidTransition(RuntimeError):
    """A bug: the request life tried a status change the table does not allow."""


class OutputFrameKind(enum.Enum):
    """A frame of the gateway's stream to its client (gateway.proto FrameKind). The workers'
    Decode frames are another vocabulary: shared.cluster.DecodeFrameKind."""

    FIRST = "first"
    CONTINUATION = "continuation"
    FINAL = "final"


@dataclass(frozen=True)
class OutputFrame:
    """One frame for the client. finish_reason and usage are set on the FINAL frame only."""

    request_id: str
    kind: OutputFrameKind
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    model: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # per generated token of the frame, when asked
    # tokens generated so far (the state's count: the workers' reports where they came, else the
    # relayed token ids), usage.completion_tokens on the FINAL frame; on other frames only with
    # RequestState.continuous_usage (else 0)
    completion_tokens: int = 0
    # on the first frame only: the prompt's ids (with return_token_ids or prompt_logprobs) and,
    # with prompt_logprobs, one entry per prompt token from the second on (prompt_token_ids[1:];
    # the first has none)
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Completion:
    """Complete's single response: the same request life as Generate, gathered."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    model: str
    logprobs: tuple[TokenLogprob, ...] = ()  # per generated token, when asked
    # with prompt_logprobs: as on OutputFrame
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class _Piece(NamedTuple):
    """Output relayed from one worker message (one per token frame: a tuple, cheap to build)."""

    text: str
    token_ids: tuple[int, ...]


@dataclass
class RequestState:
    """Owns the relayed text/token lists and the workers' reports; every count is derived."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    return_token_ids: bool
    model: str
    arrival_s: float = field(default_factory=time.monotonic)
    continuous_usage: bool = False  # every frame carries completion_tokens so far
    status: RequestStatus = RequestStatus.WAITING
    max_tokens: int = 0  # the budget of the run's placement, set when scheduled (budget.py)
    attempts: int = 0  # Schedule calls made
    migrations: int = 0  # times the request moved on after its decode worker failed mid-stream
    _pieces: list[_Piece] = field(default_factory=list)
    # present generated_tokens per (leg, worker segment); a leg is one run of the request
    _reported_counts: dict[tuple[int, Segment], int] = field(default_factory=dict)
    # what the pieces of each (leg, worker segment) stand for (fallback_tokens, saturating-summed),
    # kept as they are recorded so that counts cost no walk over every piece relayed
    _frame_tokens: dict[tuple[int, Segment], int] = field(default_factory=dict)
    _worker_finish: FinishReason | None = None
    _local_cached: int | None = None
    _transferred_cached: int | None = None
    _abort_reason: FinishReason | None = None
    _cache: CacheStats | None = None  # derived from the two above; None: not derived since they changed
    frame_times_s: list[float] = field(default_factory=list)  # when each frame went to the client
    # until the first frame: when the current attempt reached each status (time.monotonic());
    # a retry (back to WAITING) starts over, so the phases below are the successful attempt's
    _reached_s: dict[RequestStatus, float] = field(default_factory=dict)

    # --- status ---
    def advance(self, new: RequestStatus) -> None:
        if new not in ALLOWED_TRANSITIONS[self.status]:
            raise InvalidTransition(f"request {self.request_id}: {self.status.name} -> {new.name}")
        self.status = new
        if not self.frame_times_s:
            if new is RequestStatus.WAITING:
                self._reached_s.clear()
            self._reached_s[new] = time.monotonic()

    def mark_scheduled(self, max_tokens: int) -> None:
        self.advance(RequestStatus.SCHEDULED)
        self.max_tokens = max_tokens
        self.attempts += 1

    @property
    def handed_off(self) -> bool:
        """True once anything went to the client: from then on the request cannot be retried."""
        return bool(self.frame_times_s)

    def reset_for_retry(self) -> None:
        """Back to WAITING before a reschedule; only allowed while nothing was sent."""
        if self.handed_off:
            raise InvalidTransition(f"request {self.request_id}: retry after output was sent")
        self.advance(RequestStatus.WAITING)
        self._pieces.clear()
        self._reported_counts.clear()
        self._frame_tokens.clear()
        self._worker_finish = None
        self._local_cached = None
        self._transferred_cached = None
        self._cache = None

    def begin_migration(self) -> None:
        """The workers running the request failed after output reached the client: the tokens
        relayed so far stay (their count: the workers' reports where they sent one, else the
        token ids relayed, which the gateway always asks workers for) and a new leg starts, which
        continues after them (`resume_token_ids`). Cache figures stay those of the first run."""
        if self.status.is_finished:
            raise InvalidTransition(f"request {self.request_id}: migration after it finished")
        self.advance(RequestStatus.WAITING)
        self.migrations += 1
        self._worker_finish = None

    @property
    def _leg(self) -> int:
        return self.migrations

    @property
    def resume_token_ids(self) -> tuple[int, ...]:
        """The tokens generated so far, in order (what a migrated request's new prompt appends)."""
        return self.output_token_ids

    @property
    def unshown_tail_tokens(self) -> int:
        """Generated tokens at the end whose text was never relayed: the worker held it back (an
        incomplete character). Counted from the trailing pieces that carried ids but no text."""
        count = 0
        for piece in reversed(self._pieces):
            if piece.text:
                break
            count += len(piece.token_ids)
        return count

    @property
    def can_resume(self) -> bool:
        """True when the relayed token ids account for every generated token (a worker that
        returns no ids, e.g. a v1.0 one, makes the request impossible to continue exactly)."""
        return len(self.output_token_ids) == self.num_completion_tokens

    # --- recording worker output ---
    def record_output(
        self,
        source: FrameSource,
        text: str,
        token_ids: tuple[int, ...],
        generated_tokens: int | None,
        finish_reason: FinishReason | None,
    ) -> None:
        """One prefill reply or decode TOKENS/FINAL frame. `generated_tokens` is None when the field
        was absent (never confuse absent with 0: an immediate EOS reports 0)."""
        stopped = finish_reason is FinishReason.STOP
        fallback = accounting.fallback_tokens(source, text, len(token_ids), stopped)
        self._pieces.append(_Piece(text, token_ids))
        key = (self._leg, source.segment)
        self._frame_tokens[key] = accounting.saturating_add(self._frame_tokens.get(key, 0), fallback)
        if generated_tokens is not None:
            self._reported_counts[key] = accounting.saturating_add(
                self._reported_counts.get(key, 0), generated_tokens
            )
        if finish_reason is not None:
            self._worker_finish = finish_reason

    def record_cache(self, local_tokens: int, transferred_tokens: int) -> None:
        """Cache figures from a worker frame. Each is fixed by the first frame that reports it
        (non-zero); later frames cannot rewrite it (preemption/reschedule on the worker), nor can
        a migrated run (its prompt holds generated tokens: not this request's prompt)."""
        if self._leg > 0:
            return
        if self._local_cached is None and local_tokens > 0:
            self._local_cached = local_tokens
            self._cache = None
        if self._transferred_cached is None and transferred_tokens > 0:
            self._transferred_cached = transferred_tokens
            self._cache = None

    def finish(self, reason: FinishReason | None = None) -> None:
        """End the request; `reason` overrides the worker's (ABORT when the gateway cuts it short)."""
        if reason is not None:
            self._abort_reason = reason
        self.advance(STATUS_BY_FINISH_REASON[self.finish_reason])

    def fail(self) -> None:
        if not self.status.is_finished:
            self.advance(RequestStatus.FAILED)

    def note_frame_sent(self, now_s: float | None = None) -> None:
        self.frame_times_s.append(time.monotonic() if now_s is None else now_s)

    # --- derived ---
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self._pieces)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(t for p in self._pieces for t in p.token_ids)

    @property
    def has_reported_counts(self) -> bool:
        return bool(self._reported_counts)

    @property
    def worker_counts(self) -> list[WorkerCount]:
        """Per worker of each leg (prefill, decode): its reported count, or None, and its frame
        count."""
        counts = []
        for leg in range(self._leg + 1):
            for segment in Segment:
                key = (leg, segment)
                if key in self._frame_tokens or key in self._reported_counts:
                    counts.append(WorkerCount(self._reported_counts.get(key), self._frame_tokens.get(key, 0)))
        return counts

    @property
    def num_completion_tokens(self) -> int:
        return accounting.completion_tokens(self.worker_counts, self.max_tokens)

    @property
    def finish_reason(self) -> FinishReason:
        if self._abort_reason is not None:
            return self._abort_reason
        return accounting.finish_reason(self.num_completion_tokens, self.max_tokens, self._worker_finish)

    @property
    def cache(self) -> CacheStats:
        """Derived once per change of the figures (every frame sent carries cached_tokens)."""
        if self._cache is None:
            self._cache = accounting.cache_stats(
                self.num_prompt_tokens, self._local_cached or 0, self._transferred_cached or 0
            )
        return self._cache

    @property
    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_completion_tokens, self.cache)

    @property
    def ttft_s(self) -> float | None:
        return self.frame_times_s[0] - self.arrival_s if self.frame_times_s else None

    @property
    def ttft_phases_s(self) -> dict[str, float]:
        """Where the time to the first frame went (seconds; they add up to ttft_s): `schedule`
        from arrival until the workers of the attempt that answered were chosen (earlier
        attempts included), `admit` the decode worker's admission (disaggregated only; over
        NIXL to a worker that takes the gateway's ticket the prefill runs meanwhile), `prefill`
        from there to the first frame (the prompt; disaggregated, the KV handoff too where the
        first token waits for it: --first-token-before-handoff off, or an older prefill worker).
        Empty before a first frame."""
        if not self.frame_times_s:
            return {}
        first = self.frame_times_s[0]
        scheduled = min(self._reached_s.get(RequestStatus.SCHEDULED, self.arrival_s), first)
        phases = {"schedule": max(0.0, scheduled - self.arrival_s)}
        ready = scheduled
        admitted = self._reached_s.get(RequestStatus.ADMITTED)
        if admitted is not None:
            ready = min(max(admitted, scheduled), first)
            phases["admit"] = ready - scheduled
        phases["prefill"] = max(0.0, first - ready)
        return phases

    @property
    def inter_frame_s(self) -> list[float]:
        times = self.frame_times_s
        return [b - a for a, b in itertools.pairwise(times)]
