"""Rich consoles for the CLI's human output."""

from __future__ import annotations

import sys

from rich.console import Console

# Off a terminal (logs, CI, `| tee`) rich wraps at 80 columns, which cuts the benchmark and demo
# tables to unreadable stubs; give them room instead.
OFF_TERMINAL_WIDTH = 200


def make_console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else OFF_TERMINAL_WIDTH)
