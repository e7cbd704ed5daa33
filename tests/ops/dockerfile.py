"""A small reader of the repository's Dockerfile for the packaging tests: instructions per stage,
with line continuations joined and comments dropped (enough for this Dockerfile, not a parser of
every Dockerfile)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def one(self, keyword: str) -> str:
        (args,) = self.all(keyword)
        return args

    def env(self) -> dict[str, str]:
        """ENV key=value pairs (the `ENV a=1 b=2` form)."""
        out: dict[str, str] = {}
        for args in self.all("ENV"):
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                out[key] = value
        return out

    def exec_form(self, keyword: str) -> list[str]:
        value = json.loads(self.one(keyword))
        assert isinstance(value, list)
        return [str(v) for v in value]


@dataclass
class Dockerfile:
    args: dict[str, str]  # global ARGs (before the first FROM) with their defaults
    stages: dict[str, Stage]

    def arg_default(self, stage: str, name: str) -> str:
        for args in self.stages[stage].all("ARG"):
            key, _, default = args.partition("=")
            if key == name:
                return default
        raise KeyError(name)


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) in order; continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, args = current.partition(" ")
        out.append((keyword.upper(), re.sub(r"\s+", " ", args).strip()))
        current = ""
    assert not current, "a continued instruction never ends"
    return out


def read(path: Path = DOCKERFILE) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for keyword, args in instructions(path.read_text()):
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stage = stages[name] = Stage(name=name, base=words[0])
        elif stage is None:
            if keyword == "ARG":
                key, _, default = args.partition("=")
                global_args[key] = default
        else:
            stage.instructions.append((keyword, args))
    return Dockerfile(args=global_args, stages=stages)
