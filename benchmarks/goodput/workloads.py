"""Workloads of the goodput benchmark: seeded chat requests whose text comes from the bundled
corpus (`corpus.txt`, varied English prose), cut to token lengths drawn from each workload's
ranges with the served model's tokenizer, so tokenization and the prefix cache behave as with
real text.

- chat:          prompts 100-800 tokens, outputs 32-256
- long_prompt:   prompts 1000-2000 tokens, outputs 16-64 (summarization-like)
- long_output:   prompts 20-100 tokens, outputs 256-512 (writing-like)
- shared_prefix: chat behind one fixed 512-token system prompt (prefix caching matters)

Prompt lengths are those of the message text; the chat template adds a few tokens (the server's
`usage.prompt_tokens` is what the results report). Each prompt starts at a random sentence of a
random passage and continues through passages in random order, so two prompts rarely share
more than the template's prefix unless the workload says so. The same (seed, workload, run)
gives the same requests on every configuration.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

INSTRUCTIONS = {
    "chat": (
        "Read the text below and explain its main points in a few sentences.",
        "What is the following passage about? Answer briefly.",
        "Rewrite the following text in simpler words.",
        "List three questions a curious reader might ask after reading this.",
        "Summarize this for a friend who has not read it.",
        "Which part of the following text is the most surprising, and why?",
    ),
    "long_prompt": (
        "Summarize the following document in two sentences.",
        "Give a one-paragraph summary of the text below.",
        "What is the common thread of the passages below? Answer in one paragraph.",
    ),
    "long_output": (
        "Write a long, detailed essay inspired by the following note. Use several paragraphs.",
        "Continue the following text as a long story with many details.",
        "Write a thorough, multi-page explanation of the topic below for a beginner.",
    ),
}
INSTRUCTIONS["shared_prefix"] = INSTRUCTIONS["chat"]

SYSTEM_PREAMBLE = (
    "You are a helpful assistant for a library's reading service. Answer questions about the "
    "texts readers send you, clearly and politely. Here is reference material you may use:\n\n"
)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: tuple[int, int]  # inclusive range of the user message's length (tokens)
    output_tokens: tuple[int, int]  # inclusive range of max_tokens
    system_tokens: int = 0  # > 0: one fixed system prompt of this many tokens for every request

    def quick(self, max_output_tokens: int = 16) -> Workload:
        """The same workload with outputs capped at `max_output_tokens` (the --quick mode)."""
        lo, hi = self.output_tokens
        return replace(self, output_tokens=(min(lo, max_output_tokens), min(hi, max_output_tokens)))


WORKLOADS = {
    w.name: w
    for w in (
        Workload("chat", (100, 800), (32, 256)),
        Workload("long_prompt", (1000, 2000), (16, 64)),
        Workload("long_output", (20, 100), (256, 512)),
        Workload("shared_prefix", (100, 400), (32, 256), system_tokens=512),
    )
}


@dataclass(frozen=True)
class Request:
    index: int
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    message_tokens: int  # tokens of the user message's text (the drawn length)


def load_corpus(path: Path = CORPUS_PATH) -> list[list[str]]:
    """Passages (paragraphs separated by blank lines, '#' lines skipped) as lists of sentences."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.startswith("#"))
    passages = [p.strip().replace("\n", " ") for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [re.split(r"(?<=[.!?])\s+", p) for p in passages]


def _text(rng: random.Random, corpus: Sequence[Sequence[str]], tokenizer: Tokenizer, n_tokens: int) -> str:
    """Text of exactly `n_tokens` tokens (when encoded alone): from a random sentence of a random
    passage onward, then whole passages in random order, cut at the token boundary."""
    order = list(range(len(corpus)))
    rng.shuffle(order)
    first = corpus[order[0]]
    parts = [" ".join(first[rng.randrange(len(first)) :])]
    ids = tokenizer.encode(parts[0], add_special_tokens=False)
    turn = 1
    while len(ids) < n_tokens:
        parts.append(" ".join(corpus[order[turn % len(order)]]))
        turn += 1
        if turn % len(order) == 0:
            rng.shuffle(order)
        ids = tokenizer.encode("\n\n".join(parts), add_special_tokens=False)
    return tokenizer.decode(ids[:n_tokens], skip_special_tokens=True)


def system_prompt(tokenizer: Tokenizer, n_tokens: int, seed: int, corpus: Sequence[Sequence[str]]) -> str:
    """The shared system prompt: a fixed preamble and `n_tokens` tokens of reference text."""
    return SYSTEM_PREAMBLE + _text(random.Random(f"{seed}:system"), corpus, tokenizer, n_tokens)


def make_requests(
    workload: Workload,
    tokenizer: Tokenizer,
    count: int,
    seed: int,
    run: str,
    corpus: Sequence[Sequence[str]] | None = None,
) -> list[Request]:
    """`count` requests of `workload`, the same for the same (seed, workload, run)."""
    corpus = corpus if corpus is not None else load_corpus()
    rng = random.Random(f"{seed}:{workload.name}:{run}")
    system = system_prompt(tokenizer, workload.system_tokens, seed, corpus) if workload.system_tokens else ""
    requests = []
    for i in range(count):
        n_tokens = rng.randint(*workload.prompt_tokens)
        max_tokens = rng.randint(*workload.output_tokens)
        instruction = rng.choice(INSTRUCTIONS[workload.name])
        body = _text(rng, corpus, tokenizer, n_tokens)
        messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": f"{instruction}\n\n{body}"})
        requests.append(Request(i, tuple(messages), max_tokens, n_tokens))
    return requests
