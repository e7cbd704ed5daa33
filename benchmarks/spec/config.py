"""What the speculative decoding benchmark runs: the grounded and open-ended prompts, the targets
(ngram / off tokens/s), the results file and the flags."""

from __future__ import annotations

import argparse

PASSAGE = (
    "The Meridian Bridge opened in 1932 after six years of construction. It spans 1,240 metres "
    "across the Alder River and carries four lanes of traffic and two railway tracks. Its chief "
    "engineer, Clara Voss, insisted on a suspension design because the riverbed could not hold "
    "the piers a cantilever bridge would need. During the flood of 1954 the bridge was closed "
    "for eleven days while divers inspected the anchorages. A pedestrian walkway was added in "
    "1987, and in 2011 the original steel cables were replaced with galvanized ones. Today about "
    "62,000 vehicles cross the bridge every day, and the city plans to add a protected bicycle "
    "lane by 2027."
)

CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price - price * item["discount"]
        total = total + price
    total = total + total * tax_rate
    return round(total, 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
"""

GROUNDED = [
    f"Rewrite the following passage in the past perfect tense where possible, keeping every "
    f"fact:\n\n{PASSAGE}",
    f"Copy the following passage exactly, but replace the name Clara Voss with Maria Lind:\n\n{PASSAGE}",
    f"Extract every sentence of the passage that contains a year, one per line, word for word:\n\n{PASSAGE}",
    f"Rename the function total_price to compute_total and the variable items to cart in this "
    f"code. Output the whole code.\n\n{CODE}",
    f"Add a docstring to each function in this code and output the whole code:\n\n{CODE}",
    f"Repeat the passage below, then add one sentence summarizing it.\n\n{PASSAGE}",
    f"Rewrite this code so that total uses += instead of total = total + ...; output all of it.\n\n{CODE}",
    f"Correct any mistakes and output the corrected passage in full:\n\n"
    f"{PASSAGE.replace('construction', 'constructoin').replace('traffic', 'trafic')}",
]

OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three good habits for staying healthy? Explain each.",
    "Describe a day in the life of a honeybee.",
    "Give me some ideas for a birthday party for my grandmother.",
    "Why do people enjoy music? Write a few paragraphs.",
    "Write a poem about the autumn wind.",
    "What would you pack for a week-long hiking trip, and why?",
]


# issue 13: ngram / off tokens/s at least this much
TARGETS = {"grounded": {"c1": 2.0, "c8": 1.3}, "open": {"c1": 0.95, "c8": 0.95}}


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (CUDA: decode graphs on)")
    parser.add_argument("--dtype", default="", help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--requests-c1", type=int, default=4, help="requests per workload at concurrency 1")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per engine; 0 = torch default (on a shared, "
        "oversubscribed machine one thread is far steadier)",
    )
    parser.add_argument(
        "--no-step-cost",
        action="store_true",
        help="ngram without the step-cost model: every proposal verified up to the per-step cap "
        "(the behaviour before the cost model, for comparison)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each case this many times, off and ngram alternating, and report the totals "
        "(steadier ratios on a shared machine)",
    )
    parser.add_argument(
        "--draft-model",
        default="",
        help="also measure `draft` speculation with this draft model (same tokenizer). Not run by "
        "default: SmolLM2-135M is the smallest model available offline, so no smaller draft exists",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: few short requests")
    parser.add_argument(
        "--output",
        default="",
        help="default benchmarks/results/spec-<machine class>.json (-quick with --quick), the plot beside it",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.requests_c1, args.concurrency = 24, 1, 2
    return args
