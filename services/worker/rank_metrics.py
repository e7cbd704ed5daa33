"""The per-rank Prometheus figures of a worker: gauges (KV usage, tokens in use, running, waiting,
the prefill backlog) set from the engine, and the engine's cumulative counts (preemptions,
speculation, steps by kind) exported as counter increments, each counted once."""

from __future__ import annotations

from services.worker.engine.api import Engine
from services.worker.engine.spec.stats import SpecStats
from services.worker.engine.step_stats import KindStats, StepStats
from shared import metrics


class RankMetrics:
    """Exports one engine's per-rank figures (call `refresh` periodically and on GetLoad)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # per rank, engine counters already exported to Prometheus (cumulative)
        self._preemptions_seen: dict[int, int] = {}
        self._spec_seen: dict[int, SpecStats] = {}
        self._steps_seen: dict[int, StepStats] = {}
        self._offload_seen: dict[int, tuple[int, int]] = {}  # (saved, restored) exported
        self._lora_series: dict[int, set[str]] = {}  # per rank, adapters with a requests series

    def refresh(self) -> None:
        """Update the per-rank gauges and counters from the engine (called periodically and on
        GetLoad); the engine's cumulative counts become Prometheus counter increments."""
        for load in self.engine.rank_loads():
            dp_rank = load.dp_rank
            rank = str(dp_rank)
            total = self.engine.num_total_blocks(dp_rank)
            free = self.engine.num_free_blocks(dp_rank)
            metrics.KV_USAGE_RATIO.labels(dp_rank=rank).set((total - free) / total if total else 0.0)
            metrics.RANK_USED_TOKENS.labels(dp_rank=rank).set(load.num_used_tokens)
            metrics.RANK_RUNNING.labels(dp_rank=rank).set(load.num_running)
            metrics.RANK_WAITING.labels(dp_rank=rank).set(load.num_waiting)
            metrics.RANK_WAITING_PROMPT_TOKENS.labels(dp_rank=rank).set(
                self.engine.num_waiting_prompt_tokens(dp_rank)
            )
            metrics.KV_QUARANTINED_BLOCKS.labels(dp_rank=rank).set(
                self.engine.num_quarantined_blocks(dp_rank)
            )
            preempted = self.engine.num_preemptions(dp_rank)
            seen = self._preemptions_seen.get(dp_rank, 0)
            if preempted > seen:
                metrics.PREEMPTIONS.labels(dp_rank=rank).inc(preempted - seen)
                self._preemptions_seen[dp_rank] = preempted
            self._export_spec(dp_rank)
            self._export_steps(dp_rank)
            self._export_offload(dp_rank)
            self._export_lora(dp_rank)
        metrics.LORA_ADAPTERS.set(len(self.engine.lora_adapters))

    def _export_lora(self, dp_rank: int) -> None:
        """Per adapter with requests on the rank, how many; an adapter's series goes when its
        last request does (no stale series of adapters unloaded long ago)."""
        counts = self.engine.lora_requests(dp_rank)
        rank = str(dp_rank)
        for adapter, n in counts.items():
            metrics.LORA_REQUESTS.labels(dp_rank=rank, adapter=adapter).set(n)
        for adapter in self._lora_series.get(dp_rank, set()) - set(counts):
            metrics.LORA_REQUESTS.remove(rank, adapter)
        self._lora_series[dp_rank] = set(counts)

    def _export_offload(self, dp_rank: int) -> None:
        stats = self.engine.kv_offload_stats(dp_rank)
        if stats is None:
            return
        saved, restored, used, capacity = stats
        rank = str(dp_rank)
        seen_saved, seen_restored = self._offload_seen.get(dp_rank, (0, 0))
        if saved > seen_saved:
            metrics.KV_OFFLOAD_BLOCKS.labels(dp_rank=rank, direction="save").inc(saved - seen_saved)
        if restored > seen_restored:
            metrics.KV_OFFLOAD_BLOCKS.labels(dp_rank=rank, direction="restore").inc(restored - seen_restored)
        self._offload_seen[dp_rank] = (saved, restored)
        metrics.KV_OFFLOAD_USAGE_RATIO.labels(dp_rank=rank).set(used / capacity if capacity else 0.0)

    def _export_steps(self, dp_rank: int) -> None:
        now = self.engine.step_stats(dp_rank)
        seen = self._steps_seen.get(dp_rank, StepStats())
        rank = str(dp_rank)
        for kind, stats in now.by_kind.items():
            before = seen.by_kind.get(kind, KindStats())
            labels = {"dp_rank": rank, "kind": kind.value}
            if stats.steps > before.steps:
                metrics.ENGINE_STEPS.labels(**labels).inc(stats.steps - before.steps)
            if stats.ns > before.ns:
                metrics.ENGINE_STEP_SECONDS.labels(**labels).inc((stats.ns - before.ns) / 1e9)
            if stats.tokens > before.tokens:
                metrics.ENGINE_STEP_TOKENS.labels(**labels).inc(stats.tokens - before.tokens)
        self._steps_seen[dp_rank] = now

    def _export_spec(self, dp_rank: int) -> None:
        now = self.engine.spec_stats(dp_rank)
        seen = self._spec_seen.get(dp_rank, SpecStats())
        rank = str(dp_rank)
        for counter, new, old in (
            (metrics.SPEC_DRAFTS, now.num_drafts, seen.num_drafts),
            (metrics.SPEC_DRAFT_TOKENS, now.num_draft_tokens, seen.num_draft_tokens),
            (metrics.SPEC_ACCEPTED_TOKENS, now.num_accepted_tokens, seen.num_accepted_tokens),
        ):
            if new > old:
                counter.labels(dp_rank=rank).inc(new - old)
        for pos, count in enumerate(now.accepted_per_position):
            before = seen.accepted_per_position[pos] if pos < len(seen.accepted_per_position) else 0
            if count > before:
                metrics.SPEC_ACCEPTED_PER_POSITION.labels(dp_rank=rank, position=str(pos)).inc(count - before)
        if now.step_cost_ms is not None:
            for term, ms in zip(("fixed", "per_seq", "per_token", "verify"), now.step_cost_ms, strict=True):
                metrics.SPEC_STEP_COST_MS.labels(dp_rank=rank, term=term).set(ms)
        self._spec_seen[dp_rank] = now
