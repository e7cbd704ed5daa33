"""One rank's model replica and KV pool: turns a scheduled batch into one packed forward pass
(input_ids [1, T] + position_ids, no padding), then samples the sequences that finished their
prefill or decode this step."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.engine import attention
from services.worker.engine.api import KvLayoutInfo, SamplingConfig
from services.worker.engine.sampler import sample

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ScheduledSeq:
    """One request's share of a step (a snapshot: the runner never reads Request fields)."""

    token_ids: list[int]  # tokens whose K/V is computed this step
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]  # the request's block table, covering start_pos + len(token_ids)
    sample: bool  # the chunk ends at the request's last token: sample the next one
    sampling: SamplingConfig
    generator: torch.Generator | None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}")
    return _DTYPES[name]


def load_model(model_path: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    attention.register()
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION
    )
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    return model


def kv_layout_of(model_config: Any, block_size: int, dtype: torch.dtype) -> KvLayoutInfo:
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return KvLayoutInfo(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
    )


class ModelRunner:
    def __init__(self, model: Any, layout: KvLayoutInfo, num_blocks: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.num_blocks = num_blocks
        # zeros, not empty: masked-out padding rows must be finite (0 * NaN = NaN in SDPA)
        self.kv_cache = torch.zeros(
            layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
            layout.head_dim, dtype=dtype, device=device,
        )

    @property
    def bytes_per_block(self) -> int:
        lay = self.layout
        return (lay.num_layers * 2 * lay.block_size * lay.num_kv_heads * lay.head_dim
                * self.kv_cache.element_size())

    def _build_metadata(self, seqs: list[ScheduledSeq]) -> tuple[
        torch.Tensor, torch.Tensor, attention.PagedAttentionMetadata, torch.Tensor
    ]:
        bs = self.layout.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[attention.PrefillSeq] = []
        logits_idx: list[int] = []
        for s in seqs:
            q_start = len(input_ids)
            n = len(s.token_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            slot_blocks.extend(s.block_ids[p // bs] for p in pos)
            slot_offsets.extend(p % bs for p in pos)
            ctx = s.start_pos + n
            if n == 1:
                decode_idx.append(q_start)
                decode_tables.append(s.block_ids[: -(-ctx // bs)])
                decode_lens.append(ctx)
            elif s.start_pos == 0:
                prefills.append(attention.PrefillSeq(q_start, n, 0, None, None))
            else:
                blocks = torch.tensor(s.block_ids[: -(-ctx // bs)], device=self.device)
                q_pos = torch.arange(s.start_pos, ctx, device=self.device)
                mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos[:, None]
                prefills.append(attention.PrefillSeq(q_start, n, s.start_pos, blocks, mask))
            if s.sample:
                logits_idx.append(q_start + n - 1)
        dev = self.device
        decode_q = decode_bt = decode_mask = None
        if decode_idx:
            max_blocks = max(len(t) for t in decode_tables)
            decode_q = torch.tensor(decode_idx, device=dev)
            decode_bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables],
                                     device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            decode_mask = (torch.arange(max_blocks * bs, device=dev)[None, :] < lens[:, None])
            decode_mask = decode_mask[:, None, None, :]
        meta = attention.PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_blocks=torch.tensor(slot_blocks, device=dev),
            slot_offsets=torch.tensor(slot_offsets, device=dev),
            decode_q_idx=decode_q, decode_block_table=decode_bt, decode_mask=decode_mask,
            prefills=prefills,
        )
        return (torch.tensor([input_ids], device=dev), torch.tensor([positions], device=dev),
                meta, torch.tensor(logits_idx, device=dev))

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> list[int]:
        """Run one step; returns the sampled token of each seq with sample=True, in order."""
        input_ids, positions, meta, logits_idx = self._build_metadata(seqs)
        if len(logits_idx) == 0:
            # nothing to sample (only non-final prefill chunks): skip the LM head entirely
            self.model.model(input_ids=input_ids, position_ids=positions, paged_meta=meta,
                             use_cache=False)
            return []
        out = self.model(input_ids=input_ids, position_ids=positions, paged_meta=meta,
                         use_cache=False, logits_to_keep=logits_idx)
        logits = out.logits[0]  # [n, vocab]
        sampled_seqs = [s for s in seqs if s.sample]
        tokens = sample(logits, [s.sampling for s in sampled_seqs],
                        [s.generator for s in sampled_seqs])
        return [int(t) for t in tokens.tolist()]

    def warm_up(self) -> None:
        """One tiny forward (writes block 0, which holds no request yet)."""
        t0 = time.perf_counter()
        seq = ScheduledSeq(token_ids=[0] * min(4, self.layout.block_size), start_pos=0,
                           block_ids=[0], sample=True,
                           sampling=SamplingConfig(max_tokens=1, temperature=0.0), generator=None)
        self.execute([seq])
        log.debug("warm-up step took %.3f s", time.perf_counter() - t0)

    # ---- KV transfer ---------------------------------------------------------------------
    def read_blocks(self, block_ids: list[int]) -> bytes:
        """Blocks in the wire layout: per block, per layer, K then V [kv_heads, block_size, D]."""
        idx = torch.tensor(block_ids, device=self.device)
        data = self.kv_cache[:, :, idx]  # [L, 2, n, bs, H, D]
        data = data.permute(2, 0, 1, 4, 3, 5).contiguous().cpu()  # [n, L, 2, H, bs, D]
        return data.view(torch.uint8).numpy().tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        lay = self.layout
        n = len(block_ids)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        arr = raw.view(self.dtype).view(n, lay.num_layers, 2, lay.num_kv_heads,
                                        lay.block_size, lay.head_dim)
        arr = arr.permute(1, 2, 0, 4, 3, 5).to(self.device)  # [L, 2, n, bs, H, D]
        idx = torch.tensor(block_ids, device=self.device)
        self.kv_cache[:, :, idx] = arr
