"""Fault injection for verified pulls (decode role, worker side): never on unless configured.

Two faults overwrite memory a puller may READ, as a fence bug would: a retained run's partly filled
last block right after the worker digested it (``device``), and a host copy's last slot once the
copy is made (``host``). Each fires for a share of the runs or copies, taken evenly (every k-th).
The shares come from the configuration (``kvloop_fault_corrupt_retained``,
``kvloop_fault_corrupt_host``) and, with ``kvloop_fault_file``, from that file while the engine runs
(``device=<share> host=<share>``, read again when it changes, at most once a second): how
``kvloop bench chaos`` turns the fault on and off in a serving engine.
"""

from __future__ import annotations

import os
import time

from kvloop.agents.connector import telemetry as tm

KINDS = ("device", "host")
_RECHECK_S = 1.0


class FaultSwitch:
    def __init__(self, device: float = 0.0, host: float = 0.0, path: str = "") -> None:
        self.shares = {"device": device, "host": host}
        self.path = path
        self._credit = dict.fromkeys(KINDS, 0.0)
        self._checked = 0.0
        self._mtime: float | None = None

    def fires(self, kind: str) -> bool:
        """Whether this run (``device``) or copy (``host``) is to be corrupted."""
        self._refresh()
        share = self.shares[kind]
        if not share:
            return False
        self._credit[kind] += share
        if self._credit[kind] < 1.0:
            return False
        self._credit[kind] -= 1.0
        return True

    def _refresh(self) -> None:
        if not self.path:
            return
        now = time.monotonic()
        if now - self._checked < _RECHECK_S:
            return
        self._checked = now
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime == self._mtime:
                return
            with open(self.path) as f:
                text = f.read()
        except OSError:
            return  # no file: the shares stay as they are
        self._mtime = mtime
        for part in text.split():
            kind, _, value = part.partition("=")
            try:
                share = float(value)
            except ValueError:
                share = -1.0
            if kind not in KINDS or not 0.0 <= share <= 1.0:
                tm.log.warning("kvloop.fault_file_unreadable", path=self.path, part=part)
                continue
            self.shares[kind] = share
        tm.log.warning("kvloop.fault_shares", path=self.path, **self.shares)
