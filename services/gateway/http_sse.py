"""Server-sent event bytes of the streamed chunks that are written once per token: a choice's
text (chat: its content or reasoning_content delta) and finish reason, without logprobs or tool
calls. They are spliced into a template made once per stream (its id, created, model and whether
each chunk carries `"usage":null`), so no pydantic model is validated per token. The bytes are exactly
those of the pydantic chunk models (`http_models.ChatCompletionChunk` / `CompletionChunk`,
`model_dump_json`, the same key order, and strings through pydantic's own JSON encoder); every
other chunk (role, tool calls, logprobs, usage, errors) is still built from those models."""

from __future__ import annotations

from pydantic_core import to_json


def sse(payload_json: str) -> str:
    """One server-sent event carrying `payload_json`."""
    return f"data: {payload_json}\n\n"


def json_str(text: str) -> str:
    """`text` as a JSON string, exactly as pydantic writes it (non-ASCII as UTF-8, not escaped)."""
    return to_json(text).decode()


class ChunkTemplate:
    """The per-token chunks of one stream (chat: `chat.completion.chunk` with a content delta;
    completions: `text_completion` with text). `include_usage`: every chunk carries
    `"usage":null` (the OpenAI stream_options.include_usage shape); else no usage key."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool, include_usage: bool) -> None:
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._chat = chat
        self._head = (
            f'data: {{"id":{json_str(response_id)},"object":"{kind}","created":{created},'
            f'"model":{json_str(model)},"choices":[{{"index":'
        )
        self._end = (',"usage":null' if include_usage else "") + "}\n\n"  # after the choices
        self._tail = ',"logprobs":null}]' + self._end

    def event(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        key: str = "content",
        usage: str | None = None,
        stop_reason: int | str | None = None,
    ) -> str:
        """The event of choice `index`'s chunk: chat, a delta `{key: text}` (`{}` when text is
        empty; key "content", or "reasoning_content" with --reasoning-parser); completions, its
        `text`; `finish_reason` null unless given, and with it vLLM's `stop_reason` (null unless
        given); `usage` (JSON, vLLM's continuous usage) in place of the null."""
        reason = "null" if finish_reason is None else json_str(finish_reason)
        if self._chat:
            delta = f'{{"{key}":{json_str(text)}}}' if text else "{}"
            body = f'{index},"delta":{delta},"finish_reason":{reason}'
        else:
            body = f'{index},"text":{json_str(text)},"finish_reason":{reason}'
        if finish_reason is not None:
            return self._finished(body, usage, stop_reason)
        if usage is not None:
            return f'{self._head}{body},"logprobs":null}}],"usage":{usage}}}\n\n'
        return self._head + body + self._tail

    def _finished(self, body: str, usage: str | None, stop_reason: int | str | None) -> str:
        """A choice's last chunk (once per choice: no need to be quick)."""
        if stop_reason is None:
            stop = "null"
        else:
            stop = str(stop_reason) if isinstance(stop_reason, int) else json_str(stop_reason)
        head = f'{self._head}{body},"logprobs":null,"stop_reason":{stop}}}]'
        if usage is not None:
            return f'{head},"usage":{usage}}}\n\n'
        return head + self._end
