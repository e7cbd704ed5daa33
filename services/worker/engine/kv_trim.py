"""What of a prompt's KV a decode worker can still read after a handoff: the trim arithmetic of the
KV transfer on models with sliding-window layers (model_variants.attention_windows).

The decode side's first query is at position n (n = prompt tokens: the handoff token) and sees
keys n - W + 1 .. n in a layer of window W; later queries see fewer. So the leading prompt blocks
wholly behind the longest window of the windowed layers are never read by those layers again:

- every layer windowed (Mistral, windowed Qwen2 / Phi-3): the blocks are not read at all; they
  do not travel and the decode side does not hold them (Request.num_released_blocks);
- some layers full (Gemma 2 alternates, Gemma 3 has 5 windowed of 6): only the full-attention
  layers' K/V of those blocks travels; the rest of the blocks travels whole.

The decode side decides (it reserves and knows what it reads) and tells the prefill side as
`trim_blocks` (worker.proto KvTarget / DecodeFrame, protocol 1.8). Trimmed blocks never enter the
decode side's prefix cache: their windowed layers (or all of them) were never written there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvTrim:
    """One model's trim rule (the same on both workers: pairs serve the same model)."""

    num_layers: int
    # the longest window of the windowed layers (tokens); None: no layer is windowed
    window: int | None
    # layers with full causal attention, ascending (their K/V of trimmed blocks still travels)
    full_layers: tuple[int, ...]

    @classmethod
    def of(cls, windows: list[int | None]) -> KvTrim:
        """From model_variants.attention_windows (per layer: window in tokens or None)."""
        windowed = [w for w in windows if w is not None]
        return cls(
            num_layers=len(windows),
            window=max(windowed) if windowed else None,
            full_layers=tuple(i for i, w in enumerate(windows) if w is None),
        )

    @property
    def releases(self) -> bool:
        """Every layer windowed: trimmed blocks are not needed at all (nothing of them moves)."""
        return self.window is not None and not self.full_layers

    def trim_blocks(self, num_prompt_tokens: int, block_size: int) -> int:
        """Leading prompt blocks wholly behind every window at the first decode position
        (num_prompt_tokens): the same formula as Scheduler._release_behind_window with
        num_computed_tokens = num_prompt_tokens (count; 0 without windowed layers)."""
        if self.window is None or num_prompt_tokens <= 0:
            return 0
        return max(0, (num_prompt_tokens - self.window + 1) // block_size)


NO_TRIM = KvTrim(num_layers=0, window=None, full_layers=())
