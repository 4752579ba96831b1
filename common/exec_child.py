"""Become a command that dies with its launcher: ``python -I -S exec_child.py LAUNCHER_PID ARGV...``.

`kvloop.common.processes` starts each child through this instead of a Popen ``preexec_fn``: a
preexec_fn makes Python fork the launcher with its fork handlers, and gRPC's handlers in a launcher
whose gRPC threads are running made children abort (`epoll_wait: Bad file descriptor`) before exec.
This sets the Linux parent-death signal (SIGTERM), exits if the launcher is already gone, then
replaces itself with ARGV: same pid, process group, environment and file descriptors.

Standard library only (it runs in a bare interpreter, ~20 ms).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    launcher, command = int(argv[1]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        print(f"exec_child: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
    elif os.getppid() != launcher:  # the launcher died before the signal was set
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"exec_child: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv))
