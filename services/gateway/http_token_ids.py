"""vLLM's token-level extras of the HTTP responses that RL and agent frameworks read: with
`return_token_ids`, every choice's generated ids (`token_ids`, as many as its completion tokens;
streamed, the ids since its previous chunk) and the prompt's (`prompt_token_ids`: per choice on
completions, at the top level on chat; streamed, on each choice's first chunk); and `stop_reason`
on every finished choice (stop_reason.py reads it from the generated ids). Whole responses use
`ChoiceIds`; streams keep one `StreamIds`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.gateway import stop_reason as stops
from services.gateway.http_convert import Plan
from services.gateway.inputs import GenerateInput
from services.gateway.request import Completion, OutputFrame
from services.gateway.stop_reason import StopReason
from shared.cluster import FinishReason

# generated ids -> their text as the workers write it (skip_special_tokens: hide special tokens)
OutputText = Callable[[tuple[int, ...], bool], str]


def choice_stop_reason(
    inp: GenerateInput, finish_reason: FinishReason, token_ids: Sequence[int], output_text: OutputText
) -> StopReason:
    """vLLM's stop_reason of one choice run as `inp` (its generated ids: all of them)."""
    if not (inp.stop or inp.stop_token_ids):
        return None  # ended by EOS, length or an abort: nothing else can have stopped it
    skip_special = inp.skip_special_tokens and not inp.show_tool_markers  # what the workers got
    return stops.stop_reason(
        finish_reason,
        token_ids,
        inp.stop,
        inp.stop_token_ids,
        inp.include_stop_in_output,
        lambda ids: output_text(ids, skip_special),
    )


@dataclass(frozen=True)
class ChoiceIds:
    """One whole choice's extras: its stop_reason, and with return_token_ids its ids."""

    stop_reason: StopReason
    token_ids: list[int] | None  # None: not asked for (the field is left out)
    prompt_token_ids: list[int] | None

    @classmethod
    def of(cls, plan: Plan, index: int, c: Completion, output_text: OutputText) -> ChoiceIds:
        reason = choice_stop_reason(plan.inputs[index], c.finish_reason, c.token_ids, output_text)
        if not plan.return_token_ids:
            return cls(reason, None, None)
        return cls(reason, list(c.token_ids), list(c.prompt_token_ids))


class StreamIds:
    """A stream's ids per choice: the generated ids not yet sent on a chunk (a frame whose text
    is held back sends its ids with the next chunk, as its logprobs), whether the prompt's ids
    went out, and the ids a stop_reason is read from."""

    def __init__(self, plan: Plan, output_text: OutputText) -> None:
        self._plan = plan
        self._output_text = output_text
        n = len(plan.inputs)
        self._pending: list[list[int]] = [[] for _ in range(n)]
        # every generated id, kept only where a stop string may have to be found in them
        self._generated: list[list[int] | None] = [[] if inp.stop else None for inp in plan.inputs]
        self._last: list[int | None] = [None] * n  # the last generated id (a stop token?)
        self._prompt: list[tuple[int, ...] | None] = [None] * n
        self._prompt_sent = [False] * n

    @property
    def shown(self) -> bool:
        """Whether chunks carry ids (the client asked with return_token_ids)."""
        return self._plan.return_token_ids

    def note_prompt(self, index: int, frame: OutputFrame) -> None:
        """The prompt's ids, from the first frame of choice `index` that has them."""
        if frame.prompt_token_ids and self._prompt[index] is None:
            self._prompt[index] = frame.prompt_token_ids

    def record(self, index: int, frame: OutputFrame) -> None:
        """A frame of choice `index`, before its chunk is built (or skipped)."""
        self.note_prompt(index, frame)
        if not frame.token_ids:
            return
        self._last[index] = frame.token_ids[-1]
        if self.shown:
            self._pending[index].extend(frame.token_ids)
        generated = self._generated[index]
        if generated is not None:
            generated.extend(frame.token_ids)

    def take(self, index: int) -> list[int] | None:
        """The ids the chunk being sent carries (None without return_token_ids)."""
        if not self.shown:
            return None
        ids, self._pending[index] = self._pending[index], []
        return ids

    def prompt(self, index: int) -> list[int] | None:
        """The prompt's ids for choice `index`'s first chunk (then None; always None without
        return_token_ids)."""
        ids = self._prompt[index]
        if not self.shown or ids is None or self._prompt_sent[index]:
            return None
        self._prompt_sent[index] = True
        return list(ids)

    def stop_reason(self, index: int, finish_reason: FinishReason | None) -> StopReason:
        """vLLM's stop_reason of choice `index`, once its FINAL frame was recorded."""
        if finish_reason is None:
            return None
        generated = self._generated[index]
        last = self._last[index]
        ids: Sequence[int] = generated if generated is not None else (() if last is None else (last,))
        return choice_stop_reason(self._plan.inputs[index], finish_reason, ids, self._output_text)
