"""Which stop ended a request (vLLM's `stop_reason`): the stop string, or the stop token id, or
None (EOS, max_tokens, an abort). The workers say only that a request stopped (FinishReason.STOP),
so the gateway reads it from the generated token ids with vLLM's rule: a stop string found in the
output's text wins; else a last token listed in stop_token_ids; else EOS (a terminating EOS is
never among the generated ids, so EOS is None even when the client listed it in stop_token_ids,
as vLLM checks EOS first)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shared.cluster import FinishReason

StopReason = int | str | None

# token ids -> their text as the worker saw it (stop strings are matched in that text)
Decode = Callable[[tuple[int, ...]], str]


def stop_reason(
    finish_reason: FinishReason,
    token_ids: Sequence[int],
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    include_stop_in_output: bool,
    decode: Decode,
) -> StopReason:
    """`token_ids`: every generated token, the stop token (counted) included. A stop string is
    looked for as the worker matches it: the earliest occurrence in the text (on a tie the one
    listed first), without the text of a terminating stop token unless include_stop_in_output
    (the worker does not show it, so it cannot complete a stop string)."""
    if finish_reason is not FinishReason.STOP or not token_ids:
        return None
    last = token_ids[-1]
    ends_on_stop_token = last in stop_token_ids
    if stop:
        shown = token_ids[:-1] if ends_on_stop_token and not include_stop_in_output else token_ids
        found = first_stop_string(decode(tuple(shown)), stop)
        if found is not None:
            return found
    return last if ends_on_stop_token else None


def first_stop_string(text: str, stop: Sequence[str]) -> str | None:
    """The stop string that occurs first in `text` (on a tie at one position, the one listed
    first: the worker's rule), or None."""
    best: tuple[int, str] | None = None
    for s in stop:
        i = text.find(s) if s else -1
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return None if best is None else best[1]
