"""Process-group helpers, and the watchdog that stops a launcher's children when the launcher dies.

Run as a script (``python reaper.py GRACE_S``) by `kvloop.common.processes`: the launcher keeps the
write end of the watchdog's stdin and writes ``+PGID START`` / ``-PGID`` lines as it starts and
stops children (START: the group leader's start time, see `start_time`). EOF on stdin means the
launcher is gone, however it went (exit, signal, SIGKILL, OOM killer): the watchdog then stops every
group still listed (SIGTERM, a grace period, SIGKILL) and exits. SIGTERM to the watchdog does the
same; SIGINT and SIGHUP are ignored (they are the launcher's to handle).

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

# A process group: its id (the leader's pid) and the leader's start time. Process ids are reused
# (pid_max is 32768 on some hosts): once a group is gone, its number may name someone else's group.
Group = tuple[int, int | None]


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat from the state field on (comm, before it, may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), or None (gone, or no /proc)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def _reused(pgid: int, start: int | None) -> bool:
    """True when the number `pgid` now belongs to another process than the group's leader.

    While a group has members its number cannot be reused, so a process with that pid that started at
    another time means our group is gone."""
    if start is None:
        return False
    now = start_time(pgid)
    return now is not None and now != start


def group_members(pgid: int, start: int | None = None) -> list[int]:
    """Live (not zombie) processes in process group `pgid` (led by a process started at `start`)."""
    if _reused(pgid, start):
        return []
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
        fields = _stat_fields(int(name))  # state ppid pgrp ...; None: exited meanwhile
        if fields and fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            members.append(int(name))
    return members


def signal_group(pgid: int, sig: int, start: int | None = None) -> None:
    if _reused(pgid, start):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(
    groups: Iterable[Group],
    grace_s: float,
    hurry: Callable[[], bool] = lambda: False,
    poll: Callable[[], None] = lambda: None,
) -> list[int]:
    """SIGTERM every group, wait up to `grace_s` for all their members to exit (`poll` runs each round,
    e.g. to reap our own children; `hurry()` true cuts the wait short), SIGKILL what is left and wait
    for it. Returns the groups that had to be killed."""
    targets = list(groups)
    for pgid, start in targets:
        signal_group(pgid, signal.SIGTERM, start)
    deadline = time.monotonic() + grace_s
    while True:
        poll()
        alive = [(pgid, start) for pgid, start in targets if group_members(pgid, start)]
        if not alive or time.monotonic() > deadline or hurry():
            break
        time.sleep(_POLL_S)  # polling the groups' members while they shut down
    for pgid, start in alive:
        signal_group(pgid, signal.SIGKILL, start)
    deadline = time.monotonic() + 10
    while alive and time.monotonic() < deadline:
        poll()
        if not any(group_members(pgid, start) for pgid, start in alive):
            break
        time.sleep(_POLL_S)  # SIGKILL is asynchronous: until the kernel has removed them
    return [pgid for pgid, _ in alive]


class _Stop(Exception):
    pass


def _on_term(signum: int, frame: object) -> None:
    raise _Stop


def main(argv: list[str]) -> int:
    grace_s = float(argv[1]) if len(argv) > 1 else 10.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_term)
    groups: dict[int, int | None] = {}  # pgid -> leader start time; insertion order: stopped newest first
    try:
        for line in sys.stdin.buffer:
            op, *args = line.decode().split()
            if op.startswith("+"):
                groups[int(op[1:])] = int(args[0]) if args and args[0].isdigit() else None
            elif op.startswith("-"):
                groups.pop(int(op[1:]), None)
    except _Stop:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop_groups(reversed(list(groups.items())), grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
