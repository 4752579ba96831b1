"""Finding every process a launcher started, however deep, through /proc: each test gives the launcher
an environment variable with a fresh value (a mark); children inherit it, so a process carrying the
mark is one of the launcher's descendants, even after it was re-parented."""

from __future__ import annotations

import os
import selectors
import subprocess
import time
import uuid
from dataclasses import dataclass

MARK_VAR = "KVLOOP_TEST_TREE"


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    state: str
    cmdline: str


def marked_env(env: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    mark = uuid.uuid4().hex
    return {**(env if env is not None else os.environ), MARK_VAR: mark}, mark


def _stat(pid: int) -> tuple[str, int, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1]), int(fields[2])


def marked_processes(mark: str) -> list[Proc]:
    """Live (not zombie) processes whose environment carries `mark`."""
    needle = f"{MARK_VAR}={mark}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited meanwhile, or not ours
            continue
        stat = _stat(pid)
        # an empty command line: the process is exiting (its memory is already released)
        if stat is None or stat[0] in ("Z", "X") or not cmdline:
            continue
        found.append(Proc(pid, stat[1], stat[2], stat[0], cmdline))
    return found


def is_watchdog(proc: Proc) -> bool:
    return "reaper.py" in proc.cmdline


def exits_after_launcher(proc: Proc) -> bool:
    """Helpers that exit by themselves once the launcher is gone (EOF on a pipe from it): our watchdog,
    and multiprocessing's resource tracker."""
    return is_watchdog(proc) or "multiprocessing.resource_tracker" in proc.cmdline


def read_line(process: subprocess.Popen, timeout: float) -> str:
    """The next line of `process`'s stdout (a pipe), or AssertionError at the deadline or its exit."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line from pid {process.pid} within {timeout}s (got {buf!r})")
            if sel.select(left):
                chunk = os.read(process.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"pid {process.pid} closed stdout (exit {process.poll()}): {buf!r}")
                buf += chunk
    return buf.decode().splitlines()[0]
