"""Draft-model speculation: a smaller causal LM sharing the target's tokenizer proposes up to k
tokens per decoding request by greedy decoding over its own paged KV pool on the same rank.

Per request the proposer keeps a `DraftState`: a block table in the draft's pool, how many leading
tokens of the request's token_ids its K/V holds (`num_computed_tokens`), and the proposals whose K/V
it wrote after them (`fed`). The draft's KV follows the target's ACCEPTED tokens: at the next
proposal only the leading `fed` tokens the target accepted stay valid (rejected ones are rolled
back: their rows lie past num_computed_tokens and their tail blocks are freed), and everything the
draft has not computed yet (the prompt, on the first proposal; the bonus token, afterwards) is fed
first. So the draft prefills its copy of the prompt lazily, whatever the target did (chunked
prefill, prefix-cache hits, a KV import), at most `max_catchup_tokens` per round; a request still
catching up proposes nothing that round. The draft's pool has its own prefix cache (same chained
block hashes as the target's): full blocks of computed tokens are registered, so a shared prompt
prefix or a resumed request is not recomputed. Only tokens of token_ids below
num_computed_tokens are ever hashed, and writes start at num_computed_tokens, so a cached block
is never written and never holds a rejected proposal.

A round runs in three phases around the rank's lock: `plan` (locked: rollback, block allocation,
snapshots), `run` (unlocked: one forward over every request's catch-up tokens, then one batched
single-token forward per further proposal), `apply` (locked: record what the draft computed).

Proposals are the draft's argmax: a deterministic proposer, so the draft distribution is a point
mass and spec/verify.py's acceptance (keep a proposal iff it equals the target's own sample there)
is exact rejection sampling for sampled requests too (distribution-preserving, and with a seed
token-identical to decoding without speculation).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.worker.engine.api import SamplingConfig
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.model_loading import load_model
from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
from services.worker.engine.request import Request, RequestStatus
from shared.block_hash import chain_hash
from shared.errors import InvalidArgument

log = logging.getLogger(__name__)

_GREEDY = SamplingConfig(max_tokens=1, temperature=0.0)


@dataclass
class DraftState:
    """The draft model's KV of one request (touched only under the rank's lock)."""

    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # leading tokens of the request's token_ids in the draft's KV
    fed: list[int] = field(default_factory=list)  # proposals whose K/V follows them (unverified)
    num_hashed_blocks: int = 0  # leading blocks registered in the draft's prefix cache
    last_block_hash: int | None = None  # chain hash of block num_hashed_blocks - 1


@dataclass
class DraftJob:
    """One request's share of a proposal round (a snapshot: `run` reads no Request field)."""

    request: Request
    num_proposals: int  # proposals wanted (0: the catch-up does not reach the last token yet)
    start_pos: int  # position of token_ids[0] (= tokens already in the draft's KV)
    token_ids: list[int]  # catch-up tokens: what the draft has not computed yet (>= 1)
    block_ids: list[int]  # covers start_pos + len(token_ids) + num_proposals - 1 tokens
    proposals: list[int] = field(default_factory=list)  # filled by `run`


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class DraftProposer:
    def __init__(
        self,
        runner: ModelRunner,
        blocks: BlockManager,
        max_catchup_tokens: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.runner = runner
        self.blocks = blocks
        self.max_catchup_tokens = max_catchup_tokens  # draft tokens computed per round (tokens)
        self.max_model_len = max_model_len  # the draft's own limit (positions)
        self.vocab_size = vocab_size  # the target's: proposals must be ids it can embed
        self._states: dict[Request, DraftState] = {}

    # ---- bookkeeping (under the rank's lock) ---------------------------------------------
    @property
    def num_states(self) -> int:
        return len(self._states)

    def drop(self, req: Request) -> None:
        """Forget the request's draft KV (finished, aborted, released, preempted)."""
        st = self._states.pop(req, None)
        if st is not None:
            self.blocks.free(st.block_ids)

    def drop_unless_running(self) -> None:
        """After scheduling: a preempted request loses its draft KV too (recomputed on resume)."""
        for req in [r for r in self._states if r.status is not RequestStatus.RUNNING]:
            self.drop(req)

    def _resize(self, st: DraftState, num_tokens: int) -> bool:
        """Hold exactly the blocks `num_tokens` need; False (nothing changed) when the pool is
        short."""
        keep = self.blocks.blocks_needed(num_tokens)
        if len(st.block_ids) > keep:
            self.blocks.free(st.block_ids[keep:])
            del st.block_ids[keep:]
            return True
        need = keep - len(st.block_ids)
        if need == 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        after = st.block_ids[-1] if st.block_ids else None
        st.block_ids.extend(self.blocks.allocate(need, after))
        return True

    def plan(self, wants: Sequence[tuple[Request, int]]) -> list[DraftJob]:
        """Jobs for this round from (request, proposals wanted): roll each request's draft KV
        back to the tokens the target accepted, then give it blocks for its catch-up and
        proposals. A request the pool has no room for proposes nothing (no preemption)."""
        jobs: list[DraftJob] = []
        budget = self.max_catchup_tokens
        for req, wanted in wants:
            st = self._states.get(req) or self._new_state(req)
            tokens = req.token_ids
            valid = st.num_computed_tokens + _common_prefix(tokens[st.num_computed_tokens :], st.fed)
            st.num_computed_tokens, st.fed = valid, []
            todo = len(tokens) - valid  # >= 1: the last token is never in the draft's KV
            n = max(0, min(wanted, self.max_model_len - len(tokens)))
            chunk = min(todo, budget)
            if chunk < todo:
                n = 0  # still catching up: no proposals this round
            if chunk <= 0 or not self._resize(st, valid + chunk + max(0, n - 1)):
                self._resize(st, valid)  # rejected tail blocks go back either way
                continue
            budget -= chunk
            jobs.append(DraftJob(req, n, valid, list(tokens[valid : valid + chunk]), list(st.block_ids)))
        return jobs

    def _new_state(self, req: Request) -> DraftState:
        """A request's draft KV, starting from the longest cached prefix of its tokens (at least
        its last token is left to compute)."""
        bs = self.blocks.block_size
        cached = self.blocks.lookup_prefix(req.token_ids, (req.num_tokens - 1) // bs, req.hash_root)
        self.blocks.take(cached)
        st = DraftState(
            block_ids=list(cached),
            num_computed_tokens=len(cached) * bs,
            num_hashed_blocks=len(cached),
            last_block_hash=self.blocks.block_hash(cached[-1]) if cached else req.hash_root,
        )
        self._states[req] = st
        return st

    def _hash_full_blocks(self, st: DraftState, tokens: Sequence[int]) -> None:
        bs = self.blocks.block_size
        while (st.num_hashed_blocks + 1) * bs <= st.num_computed_tokens:
            k = st.num_hashed_blocks
            h = chain_hash(st.last_block_hash, tokens[k * bs : (k + 1) * bs])
            self.blocks.cache_block(st.block_ids[k], h)
            st.last_block_hash = h
            st.num_hashed_blocks = k + 1

    def apply(self, jobs: Sequence[DraftJob]) -> dict[Request, list[int]]:
        """Record what `run` computed; the proposals per request (only ids the target knows)."""
        out: dict[Request, list[int]] = {}
        for job in jobs:
            st = self._states.get(job.request)
            if st is None:  # dropped meanwhile
                continue
            st.num_computed_tokens = job.start_pos + len(job.token_ids)
            st.fed = job.proposals[:-1]  # the last proposal was never fed back
            self._hash_full_blocks(st, job.request.token_ids)
            props = job.proposals
            bad = next((i for i, t in enumerate(props) if not 0 <= t < self.vocab_size), len(props))
            out[job.request] = props[:bad]
        return out

    # ---- the forward passes (without the rank's lock) ------------------------------------
    def run(self, jobs: Sequence[DraftJob]) -> None:
        """Catch-up forward for every job (sampling the first proposal of those that reached
        their last token), then one single-token forward per further proposal."""
        if not jobs:
            return
        seqs = [
            ScheduledSeq(j.token_ids, j.start_pos, j.block_ids, j.num_proposals > 0, _GREEDY, None)
            for j in jobs
        ]
        active = [j for j in jobs if j.num_proposals > 0]
        for j, toks in zip(active, self.runner.execute(seqs), strict=True):
            j.proposals.append(toks[0])
        while True:
            active = [
                j
                for j in active
                if len(j.proposals) < j.num_proposals and 0 <= j.proposals[-1] < self.vocab_size
            ]
            if not active:
                return
            seqs = [
                ScheduledSeq(
                    [j.proposals[-1]],
                    j.start_pos + len(j.token_ids) + len(j.proposals) - 1,
                    j.block_ids,
                    True,
                    _GREEDY,
                    None,
                )
                for j in active
            ]
            for j, toks in zip(active, self.runner.execute(seqs), strict=True):
                j.proposals.append(toks[0])


def fit_to_room(wants: Sequence[tuple[Request, int]], room: int) -> list[tuple[Request, int]]:
    """Cut decoding requests' wanted proposals to `room` in all, best recent acceptance first
    (the order in which Speculation.propose gives verification room): the draft's forward
    passes for proposals the next step could not verify would be wasted. Handoffs (HELD, verified on the
    decode worker) keep theirs."""
    decoding = sorted(
        (w for w in wants if w[0].status is RequestStatus.RUNNING),
        key=lambda w: -w[0].spec.recent_acceptance,
    )
    granted: dict[Request, int] = {}
    for req, n in decoding:
        granted[req] = max(0, min(n, room))
        room -= granted[req]
    return [(req, granted.get(req, n)) for req, n in wants]


# ---- start-up ------------------------------------------------------------------------------
def check_same_tokenizer(target: Any, draft: Any, draft_name: str) -> None:
    """The draft must tokenize exactly like the target (same token -> id map): its proposals are
    target token ids. InvalidArgument saying what differs otherwise."""
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv == dv:
        return
    differ = sorted(set(tv.items()) ^ set(dv.items()))
    example = differ[0][0] if differ else "?"
    raise InvalidArgument(
        f"draft model {draft_name} does not share the target's tokenizer "
        f"({len(dv)} vs {len(tv)} tokens, e.g. {example!r} differs); "
        "--draft-model needs a model with the same tokenizer"
    )


def load_draft_model(
    path: str,
    device: torch.device,
    dtype: torch.dtype,
    prepack: bool,
    target_vocab_size: int,
    row_copy: bool = False,
) -> Any:
    """The draft model (like the target: transformers' class with paged attention); a load
    failure or an embedding smaller than the target's vocabulary is an InvalidArgument."""
    try:
        model = load_model(path, device, dtype, prepack=prepack, row_copy=row_copy)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InvalidArgument(f"cannot load draft model {path}: {first}") from exc
    vocab = int(model.config.get_text_config().vocab_size)
    if vocab < target_vocab_size:
        raise InvalidArgument(
            f"draft model {path} has {vocab} token embeddings, the target {target_vocab_size}: "
            "--draft-model needs a model with the same tokenizer"
        )
    return model
