"""Files a configuration names (certificates, keys, token files), and configuration errors as one line.

File paths expand environment variables, so a unit's credentials can be named where systemd puts
them: ``key_file = "${CREDENTIALS_DIRECTORY}/tls.key"`` (LoadCredential=). Every named file is opened
while the settings are built: a missing key is a configuration error at start (and in
``--check-config``), not a traceback once the server binds.

Errors are formatted from pydantic's structured errors (the key's location and the message) and
never from its text, which quotes the offending input: a too-short token must not be echoed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, ValidationError


def _expand(value: object) -> object:
    return os.path.expandvars(value) if isinstance(value, str) else value


def _readable(path: Path) -> Path:
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    return path


# A file the process must be able to read: environment variables expanded, opened at load time.
ReadableFile = Annotated[Path, BeforeValidator(_expand), AfterValidator(_readable)]


def read_secret(path: Path) -> str:
    """A token or password kept in a file of its own (surrounding whitespace and newline stripped)."""
    try:
        value = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not value:
        raise ValueError(f"{path} is empty")
    return value


_PROBLEMS = {
    "extra_forbidden": "unknown key",
    "missing": "required, not set",
}


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(settings)"


def error_lines(exc: ValidationError, origin: Callable[[str], str]) -> list[str]:
    """One line per problem: where the value came from (``origin(top-level key)``: a file, an
    environment variable, a flag), the key, and what is wrong; never the value itself."""
    lines = []
    for error in exc.errors(include_input=False, include_url=False):
        loc = tuple(error["loc"])
        message = _PROBLEMS.get(error["type"]) or str(error["msg"]).removeprefix("Value error, ")
        where = origin(str(loc[0])) if loc else origin("")
        lines.append(f"{where}: {_location(loc)}: {message}")
    return lines
