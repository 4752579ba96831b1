"""systemd's service notifications (sd_notify(3)): READY=1, STOPPING=1, STATUS=..., WATCHDOG=1.

The protocol is one datagram of newline-separated ``KEY=VALUE`` lines sent to the AF_UNIX socket named
by ``$NOTIFY_SOCKET`` (a leading ``@`` names an abstract socket). systemd documents it as a stable
interface that services may implement themselves; the maintained Python bindings (systemd-python,
cysystemd) are C extensions that need libsystemd's headers to build, which is a lot to carry for these
few lines. Outside systemd (``NOTIFY_SOCKET`` unset) every call is a no-op.

The watchdog is pinged from a task on the serving event loop, not from a thread: a loop that stops
turning (a handler stuck in a blocking call) stops the pings, and systemd restarts the service after
``WatchdogSec=``, which is exactly the hang a thread would hide.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger("kvloop.sd_notify")


class Notifier:
    """Sends notifications to the service manager named in the environment (if any)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket: its address starts with a NUL byte.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket: socket.socket | None = None
        self._failed = False
        self.watchdog_interval_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process systemd expects pings from; another process (a child that
        # inherited the environment) must not ping on its behalf.
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            # sd_watchdog_enabled(3): ping at half the timeout.
            self.watchdog_interval_s = int(usec) / 1e6 / 2

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, *fields: str) -> bool:
        """One notification; False when there is no service manager or it could not be reached
        (logged once: a lost notification must not take the service down)."""
        if not self._address or self._failed:
            return False
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._socket.setblocking(False)
            self._socket.sendto("\n".join(fields).encode(), self._address)
            return True
        except OSError as exc:
            self._failed = True
            log.warning("cannot notify the service manager", socket=self._address, error=str(exc))
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str = "") -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    async def watchdog(self) -> None:
        """Ping until cancelled (returns at once when systemd asked for no watchdog)."""
        if self.watchdog_interval_s is None or not self._address:
            return
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval_s)

    def start_watchdog(self) -> asyncio.Task[None]:
        return asyncio.create_task(self.watchdog(), name="systemd watchdog")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
