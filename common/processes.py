"""Child processes that never outlive the command that started them.

Every kvloop command that starts other processes (`kvloop demo`, `kvloop engine`, the benchmarks, the
test fixtures) starts them through one `ChildProcesses` (the process-wide `supervisor()`):

- each child runs in a process group of its own, so a stop reaches what the child started too (a
  `vllm serve` and its engine-core process) and a terminal's Ctrl-C reaches only the launcher,
  which then stops the children in order;
- the launcher stops a child by its group: SIGTERM, a grace period, SIGKILL;
- inside `stop_on_signals()`, SIGTERM, SIGINT and SIGHUP raise `Terminated` in the main thread, the
  launcher's own `finally` blocks stop what they started, every child still running is stopped on
  the way out, and the command exits with 128 + the signal number;
- when the launcher dies without cleaning up (SIGKILL, the OOM killer, a crash), two things stop the
  children: each direct child gets SIGTERM from the kernel (Linux parent-death signal, set by
  `kvloop.common.exec_child` before it execs the command, for children started from the main
  thread: the signal follows the *thread* that forked), and a small watchdog process
  (`kvloop.common.reaper`) that sees its stdin pipe from the launcher close stops every listed
  group, grandchildren included, SIGKILL after the grace period.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvloop.common import exec_child, reaper

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
DEFAULT_GRACE_S = 20.0  # a vllm serve needs a few seconds to shut its engine core down on 2 cores

_PR_SET_PDEATHSIG = 1
_prctl: Any = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _prctl.restype = ctypes.c_int
    except (OSError, AttributeError):
        _prctl = None


class Terminated(BaseException):
    """A stop signal arrived (raised in the main thread inside `stop_on_signals`)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when the thread that started it exits (Linux).

    For processes that cannot be started through `ChildProcesses.spawn` (multiprocessing children
    call it first thing). With `parent_pid`, a parent that already died sends `sig` now. Returns
    False where the platform has no parent-death signal."""
    if _prctl is None or _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


class ChildProcesses:
    """The children of this process, each in its own process group (see the module docstring)."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, watchdog: bool = True) -> None:
        self.grace_s = grace_s
        self._watchdog_enabled = watchdog
        self._children: list[subprocess.Popen] = []  # in start order
        # pid -> how many children were spawned before it (what a stop_on_signals block started)
        self._spawn_index: dict[int, int] = {}
        self._spawned = 0
        self._starts: dict[int, int | None] = {}  # pid -> start time (see reaper.Group)
        self._lock = threading.RLock()
        self._watchdog: subprocess.Popen | None = None
        self._watchdog_fd: int | None = None
        self._deferring = 0
        self._pending: int | None = None  # a signal that arrived inside a critical section
        self._signalled: int | None = None  # the first stop signal seen by stop_on_signals
        self._hurry = False  # a second stop signal: skip the rest of the grace period
        self._redeliver: int | None = None  # a Terminated swallowed where exceptions are ignored

    # ---- starting --------------------------------------------------------------------------

    def spawn(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        stdin: Any = subprocess.DEVNULL,
        stdout: Any = None,
        stderr: Any = None,
        cwd: str | Path | None = None,
        **popen_kwargs: Any,
    ) -> subprocess.Popen:
        """Start `args` in a new process group, registered with the watchdog. stdin defaults to
        /dev/null (a background group reading the terminal would be stopped by SIGTTIN)."""
        command = [os.fspath(a) for a in args]
        # what Popen would raise: the command execs only later, in the child
        if os.sep in command[0]:
            found = os.access(Path(cwd or ".") / command[0], os.X_OK)
        else:
            found = (
                shutil.which(command[0], path=(env if env is not None else os.environ).get("PATH"))
                is not None
            )
        if not found:
            raise FileNotFoundError(f"{command[0]}: not found or not executable")
        if _prctl is not None and threading.current_thread() is threading.main_thread():
            # the parent-death signal follows the thread that forks: only the main thread lives as
            # long as this process
            command = [sys.executable, "-I", "-S", exec_child.__file__, str(os.getpid()), *command]
        with self._critical():
            self._forget_finished()
            self._ensure_watchdog()
            proc = subprocess.Popen(
                command,
                env=env,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                cwd=cwd,
                process_group=0,
                **popen_kwargs,
            )
            with self._lock:
                self._children.append(proc)
                self._spawn_index[proc.pid] = self._spawned
                self._spawned += 1
                self._starts[proc.pid] = reaper.start_time(proc.pid)
                self._tell_watchdog(f"+{proc.pid} {self._starts[proc.pid]}")
        return proc

    @property
    def running(self) -> list[subprocess.Popen]:
        """Children whose process group still has live members."""
        with self._lock:
            return [p for p in self._children if self._alive(p)]

    def _alive(self, proc: subprocess.Popen) -> bool:
        return proc.poll() is None or bool(reaper.group_members(proc.pid, self._starts.get(proc.pid)))

    # ---- stopping --------------------------------------------------------------------------

    def stop_all(self, grace_s: float | None = None, started_after: int = 0) -> None:
        """Stop every child still running (or only those started after the first `started_after`
        spawns), together."""
        with self._lock:
            targets = [
                p for p in reversed(self._children) if self._spawn_index.get(p.pid, 0) >= started_after
            ]
        self.stop(*targets, grace_s=grace_s)

    def stop(self, *procs: subprocess.Popen | None, grace_s: float | None = None) -> None:
        """Stop the given children together (None entries are skipped): SIGTERM their groups, wait up
        to `grace_s` for every member to exit, SIGKILL what is left. Signals that arrive meanwhile
        are held until it is done."""
        targets = [p for p in procs if p is not None]
        if not targets:
            return
        with self._critical():

            def reap() -> None:
                for p in targets:
                    p.poll()

            reaper.stop_groups(
                [(p.pid, self._starts.get(p.pid)) for p in targets if self._alive(p)],
                self.grace_s if grace_s is None else grace_s,
                hurry=lambda: self._hurry,
                poll=reap,
            )
            for p in targets:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
            self._forget_finished()

    def _forget_finished(self) -> None:
        with self._lock:
            for p in [p for p in self._children if not self._alive(p)]:
                self._children.remove(p)
                self._starts.pop(p.pid, None)
                self._tell_watchdog(f"-{p.pid}")

    # ---- the watchdog ----------------------------------------------------------------------

    def _ensure_watchdog(self) -> None:
        if not self._watchdog_enabled or (self._watchdog is not None and self._watchdog.poll() is None):
            return
        if self._watchdog_fd is not None:
            os.close(self._watchdog_fd)
        read_fd, write_fd = os.pipe()  # both close-on-exec: no child but the watchdog holds them
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-I", reaper.__file__, str(self.grace_s)],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                process_group=0,
            )
        finally:
            os.close(read_fd)
        self._watchdog_fd = write_fd
        with self._lock:
            for p in self._children:  # a restarted watchdog learns the groups still running
                self._tell_watchdog(f"+{p.pid} {self._starts.get(p.pid)}")

    def _tell_watchdog(self, line: str) -> None:
        if self._watchdog_fd is None:
            return
        try:
            os.write(self._watchdog_fd, f"{line}\n".encode())
        except OSError:  # the watchdog died; the next spawn starts another
            pass

    def close(self) -> None:
        """Stop every child, then let the watchdog exit."""
        self.stop_all()
        if self._watchdog_fd is not None:
            os.close(self._watchdog_fd)
            self._watchdog_fd = None
        if self._watchdog is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(5)

    # ---- signals ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _critical(self) -> Iterator[None]:
        """Hold a stop signal until the block is done (a child started but not yet recorded, or a
        stop half done, must not be interrupted)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if self._deferring == 0 and self._pending is not None:
                signum, self._pending = self._pending, None
                raise Terminated(signum)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._redeliver is not None:  # the stop a finalizer swallowed, raised again (see below)
            signum, self._redeliver = self._redeliver, None
            raise Terminated(signum)
        if self._signalled is not None:  # a second signal: stop without the rest of the grace period
            self._hurry = True
            return
        self._signalled = signum
        if self._deferring:
            self._pending = signum
            return
        raise Terminated(signum)

    @contextlib.contextmanager
    def stop_on_signals(self, signals: Sequence[int] = STOP_SIGNALS) -> Iterator[ChildProcesses]:
        """Within the block, the first of `signals` raises `Terminated` in the main thread (a second
        one cuts the grace period short). On the way out, however it is left, every child started
        inside the block and still running is stopped (children started before it are their starter's
        to stop: a command run in-process must not stop a test session's daemon); a `Terminated`
        leaving the block becomes ``SystemExit(128 + signum)``. Call from the main thread."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable(previous_hook)
        with self._lock:
            first = self._spawned
        try:
            try:
                yield self
            finally:
                self.stop_all(started_after=first)
        except Terminated as exc:
            self.stop_all(started_after=first)
            raise SystemExit(exc.exit_code) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            sys.unraisablehook = previous_hook
            self._signalled, self._pending, self._hurry, self._redeliver = None, None, False, None

    def _unraisable(self, previous: Callable[[Any], object]) -> Callable[[Any], object]:
        """A signal handler runs between any two bytecodes of the main thread, so its `Terminated`
        can be raised inside a finalizer (a gRPC call object's ``__del__``, a weakref callback), where
        Python prints an exception and drops it: the stop would be lost and the command run on. Such
        a `Terminated` is raised again: the signal is sent to the main thread once more, from another
        thread a moment later (raised from this hook, it would be dropped the same way)."""
        main = threading.main_thread().ident
        assert main is not None

        def hook(unraisable: Any) -> None:
            if isinstance(unraisable.exc_value, Terminated):
                self._redeliver = unraisable.exc_value.signum
                threading.Timer(0.01, signal.pthread_kill, (main, self._redeliver)).start()
                return
            previous(unraisable)

        return hook


_supervisor: ChildProcesses | None = None


def supervisor() -> ChildProcesses:
    """This process's `ChildProcesses` (one watchdog and one set of signal handlers per process)."""
    global _supervisor
    if _supervisor is None:
        _supervisor = ChildProcesses()
    return _supervisor
