"""Which worker capabilities a request's sampling features need, and the refusal of a placement
whose workers advertise capabilities but lack one of those (an older worker would silently
ignore the field): WorkerLacksFeature, retried elsewhere like a capacity refusal."""

from __future__ import annotations

from services.gateway.inputs import Sampling
from services.gateway.ports import Placement, WorkerLacksFeature


# the worker capability (services/worker/messages.py) each optional sampling feature needs
def needed_capabilities(s: Sampling) -> set[str]:
    needed = set()
    if (
        s.presence_penalty
        or s.frequency_penalty
        or s.repetition_penalty != 1.0
        or s.logit_bias
        or s.min_tokens
    ):
        needed.add("sampling_penalties")
    if s.logprobs is not None:
        needed.add("logprobs")
    if s.structured is not None:
        needed.add("structured_outputs")
        if s.structured.kind == "grammar":
            needed.add("structured_grammar")
    if s.prompt_logprobs is not None:
        needed.add("prompt_logprobs")
    if s.min_p:
        needed.add("min_p")
    if s.cache_salt:  # an older worker would share its cache across salts
        needed.add("cache_salt")
    if not s.skip_special_tokens and not s.special_tokens_hint:  # an older worker would hide them
        needed.add("show_special_tokens")
    if s.lora_adapter:  # an older worker would serve the base model instead
        needed.add("lora")
    if s.allowed_token_ids:  # an older worker would draw any token
        needed.add("allowed_token_ids")
    if s.bad_words:  # an older worker would write them
        needed.add("bad_words")
    if s.thinking_budget is not None:  # an older worker would let the model think on
        needed.add("thinking_token_budget")
    return needed


def check_capabilities(s: Sampling, placement: Placement) -> None:
    """Raise WorkerLacksFeature when a chosen worker advertises capabilities but not one the
    request needs (an older worker would ignore the field). Targets without any capabilities
    listed (an old scheduler) are not checked."""
    needed = needed_capabilities(s)
    if not needed:
        return
    for target in (placement.prefill, placement.decode):
        if target is None or not target.capabilities:
            continue
        missing = needed - set(target.capabilities)
        if missing:
            raise WorkerLacksFeature(
                f"worker {target.worker_id} is older than this request needs (it lacks "
                f"{', '.join(sorted(missing))}); retry later, or leave out those fields",
                target.worker_id,
            )
