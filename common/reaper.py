"""Process-group helpers, and the watchdog that stops a launcher's children when the launcher dies.

Run as a script (``python reaper.py GRACE_S``) by `kvloop.common.processes`: the launcher keeps the
write end of the watchdog's stdin and writes ``+PGID`` / ``-PGID`` lines as it starts and stops
children. EOF on stdin means the launcher is gone, however it went (exit, signal, SIGKILL, OOM
killer): the watchdog then stops every group still listed (SIGTERM, a grace period, SIGKILL) and
exits. SIGTERM to the watchdog does the same; SIGINT and SIGHUP are ignored (they are the
launcher's to handle).

Standard library only: the script starts in a bare interpreter (``python -I``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable

_POLL_S = 0.05


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:  # someone else's group now: not ours to stop
        return []
    if not os.path.isdir("/proc"):
        return [pgid]
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            members.append(int(name))
    return members


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(
    pgids: Iterable[int],
    grace_s: float,
    hurry: Callable[[], bool] = lambda: False,
    poll: Callable[[], None] = lambda: None,
) -> list[int]:
    """SIGTERM every group, wait up to `grace_s` for all their members to exit (`poll` runs each round,
    e.g. to reap our own children; `hurry()` true cuts the wait short), SIGKILL what is left and wait
    for it. Returns the groups that had to be killed."""
    groups = list(pgids)
    for pgid in groups:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while True:
        poll()
        alive = [g for g in groups if group_members(g)]
        if not alive or time.monotonic() > deadline or hurry():
            break
        time.sleep(_POLL_S)  # polling the groups' members while they shut down
    for pgid in alive:
        signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive and time.monotonic() < deadline:
        poll()
        if not any(group_members(g) for g in alive):
            break
        time.sleep(_POLL_S)  # SIGKILL is asynchronous: until the kernel has removed them
    return alive


class _Stop(Exception):
    pass


def _on_term(signum: int, frame: object) -> None:
    raise _Stop


def main(argv: list[str]) -> int:
    grace_s = float(argv[1]) if len(argv) > 1 else 10.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_term)
    groups: dict[int, None] = {}  # insertion order: stopped newest first
    try:
        for line in sys.stdin.buffer:
            text = line.strip().decode()
            if text[:1] == "+":
                groups[int(text[1:])] = None
            elif text[:1] == "-":
                groups.pop(int(text[1:]), None)
    except _Stop:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop_groups(reversed(list(groups)), grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
