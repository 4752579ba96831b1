"""Fail when the project's files speak of how it was developed instead of what it is.

The README, docs, code and comments describe kvloop itself. A reference to a development round (the
words session, stop, round or issue followed by a number; this, last, earlier, previous or later
before one of the first three; a bare issue number after a hash sign) or a commit id given as
evidence (after the word commit, or alone in parentheses) means nothing to a reader of the project
and goes stale. Upstream projects' issue references stay allowed: a project or owner/repo name right
before the hash sign.

Usage: ``python scripts/check_wording.py [FILE ...]``. Without files it checks every file
``git ls-files`` lists, the checker's own tests aside, whose kind is prose or source (Markdown,
Python, proto, TOML, Lua, YAML, Makefile, systemd units, the CI script). Prints ``file:line: match``
per hit and exits 1 when there is any, 0 otherwise.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

SUFFIXES = (".md", ".py", ".pyi", ".proto", ".toml", ".lua", ".yaml", ".yml", ".service")
NAMES = ("Makefile", "run")  # .ci/run
# The checker's own tests spell what it must catch.
SKIPPED = ("tests/test_wording.py",)

# One of the four words, a space and a number (not a decimal such as a figure in milliseconds).
_ROUND = re.compile(r"\b(?:session|stop|round|issue) [0-9]+\b(?![.,][0-9])", re.IGNORECASE)
# The same words after this, last, earlier, previous or later.
_RELATIVE = re.compile(
    r"\b(?:this|last|earlier|previous|later) (?:session|stop|round)s?\b",
    re.IGNORECASE,
)
# A hash sign and up to five digits as an issue or pull-request number: not a colour or an anchor
# (hex digits or letters follow), not an upstream project's (its name or owner/repo right before it).
_NUMBER_REF = re.compile(r"(?<![\w/&#])#([0-9]{1,5})\b")
_UPSTREAM_BEFORE = re.compile(
    r"(?:[A-Za-z][\w.-]*/[\w.-]+|\b(?:vLLM|vllm|NIXL|nixl|UCX|ucx|gRPC|grpc|grpcio|protobuf|Redis|redis|"
    r"Valkey|valkey|PyTorch|torch|llm-d|Dynamo|LMCache|transformers|tokenizers|structlog|OpenTelemetry|"
    r"opentelemetry|CPython|Python|python|pydantic|typer|hypothesis|ruff|mypy|buf|numpy|aiohttp|pyzmq|"
    r"hiredis|msgspec|prometheus_client|upstream))\s?$"
)
# A commit id given as evidence: after the word commit, or opening a parenthesis (closed, or followed
# by a comma, semicolon or colon). Only strings of 7-12 hex characters with at least one digit and one
# letter, so neither numbers nor words match.
_HEX = r"(?=[0-9a-f]{0,11}[0-9])(?=[0-9a-f]{0,11}[a-f])[0-9a-f]{7,12}"
_COMMIT = re.compile(rf"\bcommits? {_HEX}\b|\({_HEX}(?=[,;:)])", re.IGNORECASE)


def hits(text: str) -> Iterator[tuple[int, str]]:
    """(line number, matched text) for every development-round reference in ``text``."""
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern in (_ROUND, _RELATIVE, _COMMIT):
            for match in pattern.finditer(line):
                yield number, match.group(0)
        for match in _NUMBER_REF.finditer(line):
            if not _UPSTREAM_BEFORE.search(line[: match.start()]):
                yield number, match.group(0)


def tracked_files(root: Path) -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    return [
        root / name
        for name in listed
        if name and name not in SKIPPED and (name.endswith(SUFFIXES) or Path(name).name in NAMES)
    ]


def check(paths: Iterable[Path], root: Path) -> list[str]:
    problems = []
    for path in paths:
        if not path.is_file():  # listed by git but deleted in the working tree
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        shown = path.relative_to(root) if path.is_relative_to(root) else path
        problems += [f"{shown}:{number}: {found}" for number, found in hits(text)]
    return problems


def main(argv: list[str]) -> int:
    # the checkout the command runs in (`make lint` runs it at the project's root)
    root = Path(
        subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    paths = [Path(arg).resolve() for arg in argv] if argv else tracked_files(root)
    problems = check(paths, root)
    for problem in problems:
        print(problem)
    if problems:
        print(
            f"{len(problems)} reference(s) to how the project was developed: the project speaks of "
            "itself only (say what the code does and how it was measured, with the command and date)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
