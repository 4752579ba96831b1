"""A launcher for tests/test_processes.py: starts a small real process tree through
`ChildProcesses` and runs until a signal, like `kvloop demo --keep-running` does.

    python -m tests.process_tree GRACE_S [--no-watchdog]

The tree: a kvloopd; a shell with two `sleep` grandchildren (one process group); a shell that
ignores SIGTERM, with a `sleep` grandchild that ignores it too (only SIGKILL stops that group); a
multiprocessing child that asked for a parent-death signal (as the benchmark's and the engine tests'
multiprocessing children do).
Prints one JSON line (the children's pids) on stdout once everything is started.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

from kvloop.common.addresses import free_port
from kvloop.common.processes import ChildProcesses, die_with_parent


def _mp_child() -> None:
    parent = multiprocessing.parent_process()
    die_with_parent(parent_pid=parent.pid if parent else None)
    time.sleep(600)  # until the parent-death signal


def main() -> None:
    children = ChildProcesses(grace_s=float(sys.argv[1]), watchdog="--no-watchdog" not in sys.argv)
    kvloopd = str(Path(sys.executable).parent / "kvloopd")
    with children.stop_on_signals():
        daemon = children.spawn(
            [kvloopd, "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", "", "--log-json"],
            stderr=subprocess.DEVNULL,
        )
        shell = children.spawn(["sh", "-c", "sleep 600 & sleep 600 & wait"])
        stubborn = children.spawn(["sh", "-c", "trap '' TERM; sleep 600 & wait; sleep 600"])
        mp_child = multiprocessing.get_context("spawn").Process(target=_mp_child, daemon=True)
        mp_child.start()
        pids = {"daemon": daemon.pid, "shell": shell.pid, "stubborn": stubborn.pid, "mp": mp_child.pid}
        sys.stdout.write(json.dumps(pids) + "\n")
        sys.stdout.flush()
        while True:
            time.sleep(3600)  # until a signal


if __name__ == "__main__":
    main()
