"""The grpcurl recipes of the README's operations section, as commands a test can run verbatim.

The section lies between `<!-- ops:start -->` and `<!-- ops:end -->` in README.md. A recipe is a
line of a fenced ```sh block there whose first word is `grpcurl` (one command per line; a trailing
backslash continues it on the next line; `#` lines and other commands such as helm are skipped).

    from tests.ops.grpcurl_recipes import recipes, recipe_argv
    for command in recipes():            # 'grpcurl -plaintext 127.0.0.1:50051 list', ...
        subprocess.run(recipe_argv(command, grpcurl=".venv/bin/grpcurl"), check=True)
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
START = "<!-- ops:start -->"
END = "<!-- ops:end -->"

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


class RecipeError(ValueError):
    """The README has no well-formed operations section."""


def ops_section(markdown: str) -> str:
    """The text between the ops markers (exactly one pair, start before end)."""
    if markdown.count(START) != 1 or markdown.count(END) != 1:
        raise RecipeError(f"README must contain {START} and {END} exactly once each")
    start, end = markdown.index(START), markdown.index(END)
    if end < start:
        raise RecipeError(f"{END} comes before {START}")
    return markdown[start + len(START) : end]


def sh_blocks(markdown: str) -> list[list[str]]:
    """Lines of each fenced block tagged sh / bash / shell / console, in order."""
    blocks: list[list[str]] = []
    fence: str | None = None
    current: list[str] | None = None
    for line in markdown.splitlines():
        stripped = line.strip()
        if fence is None:
            m = _FENCE.match(stripped)
            if m:
                fence = m.group(1)
                current = [] if m.group(2).lower() in ("sh", "bash", "shell", "console") else None
            continue
        if stripped.startswith(fence[0] * len(fence)) and stripped.strip(fence[0]) == "":
            if current is not None:
                blocks.append(current)
            fence, current = None, None
            continue
        if current is not None:
            current.append(line)
    if fence is not None:
        raise RecipeError("unterminated code fence in the operations section")
    return blocks


def commands(lines: list[str]) -> list[str]:
    """Shell commands of a block: comments and blank lines skipped, backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for raw in lines:
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        out.append((pending + line).strip())
        pending = ""
    if pending:
        out.append(pending.strip())
    return out


def parse_recipes(markdown: str) -> list[str]:
    """The grpcurl commands of the operations section of `markdown`, in document order."""
    section = ops_section(markdown)
    found = []
    for block in sh_blocks(section):
        for command in commands(block):
            argv = shlex.split(command)
            if argv and argv[0] == "grpcurl":
                found.append(command)
    return found


def recipes(readme: Path = README) -> list[str]:
    """The grpcurl recipes of the repository's README."""
    return parse_recipes(readme.read_text(encoding="utf-8"))


def recipe_argv(
    command: str, grpcurl: str = "grpcurl", addresses: Mapping[str, str] | None = None
) -> list[str]:
    """argv of a recipe, with the grpcurl binary and (optionally) addresses replaced, e.g.
    {"127.0.0.1:50051": "127.0.0.1:40123"} to aim it at a stack on other ports."""
    argv = shlex.split(command)
    if not argv or argv[0] != "grpcurl":
        raise RecipeError(f"not a grpcurl command: {command!r}")
    mapping = addresses or {}
    return [grpcurl, *(mapping.get(arg, arg) for arg in argv[1:])]
