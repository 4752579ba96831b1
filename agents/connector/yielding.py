"""Confirming that the directory dropped a retained run a decode gives up before its lease ends.

Past ``YIELD_AT`` of its retention share, a decode gives up its oldest retained runs, those retained
longer ago than ``retention_yield_after_s``, so that newer turns fit (:class:`~.decode.DecodeSide`).
Freeing a run's blocks while a prefill may still READ them would hand that prefill another request's
KV, so a run is given up in three steps:

1. its ``RetentionReleased`` goes out at once: the directory drops it and hands it out no more;
2. :class:`ReleaseConfirmer` (a thread) asks FindBlock until the directory no longer lists it, while
   it serves this decode in sync (ACTIVE, no resync in between: a directory still rebuilding the
   decode's state from its agent's snapshot lists nothing yet, and may list the run again). That
   answer also carries the directory's read window: every handout (Lookup, Route plan) caps
   ``Holder.expires_in_ms`` at it, so a puller reads a run within that long of being handed it, or
   recomputes;
3. the blocks are freed a read window plus the READ margin after that answer, the way a lease end
   frees them: no handout made before the drop can still be read.

While the directory cannot be reached (or answers without a read window: an older kvloopd), a run is
not confirmed and keeps its lease: giving up is only ever early when it is safe.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.directory import TracedDirectoryClient
from kvloop.clients.directory_client import DirectoryClient, KvloopError
from kvloop.common.tracing import not_sampled
from kvloop.v1 import directory_pb2 as pb

# Share of ``retention_max_share`` past which the oldest retained runs are given up: the rest of
# the share takes the turns that finish during the read window it takes to free them.
YIELD_AT = 0.9


@dataclass(frozen=True)
class GivenUp:
    """A retained run the directory was told is gone, to be freed once that is confirmed."""

    handle: str
    first_hash: bytes  # the run's first block, where FindBlock lists it
    lora_name: str


@dataclass(frozen=True)
class Confirmed:
    handle: str
    # perf_counter time the blocks may be freed; None: not confirmed in time, the run keeps its lease
    free_at: float | None


class ReleaseConfirmer:
    """Asks FindBlock, off the engine loop, until each run given up is no longer listed."""

    def __init__(
        self,
        daemon: str,
        model: str,
        worker_id: str,
        read_margin_s: float,
        poll_s: float = 0.05,
        give_up_after_s: float = 10.0,
    ) -> None:
        self.daemon = daemon
        self.model = model
        self.worker_id = worker_id
        self.read_margin_s = read_margin_s
        self.poll_s = poll_s
        self.give_up_after_s = give_up_after_s
        self._asked: queue.SimpleQueue[tuple[GivenUp, float]] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Confirmed] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def submit(self, run: GivenUp) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvloop-release-confirmer", daemon=True)
            self._thread.start()
        self._asked.put((run, time.perf_counter()))

    def take(self) -> list[Confirmed]:
        """The runs settled since the last call (engine loop)."""
        return _drain(self._done)

    def stop(self) -> None:
        self._stop.set()

    def check(self, client: DirectoryClient, run: GivenUp) -> float | None:
        """When ``run``'s blocks may be freed, if the directory no longer lists it while it serves
        this decode in sync; else None."""
        return self.check_all(client, [run]).get(run.handle)

    def check_all(self, client: DirectoryClient, runs: list[GivenUp]) -> dict[str, float]:
        """When each of ``runs`` the directory no longer lists, while it serves this decode in sync
        (one check of that around all their FindBlocks), may be freed: handle -> perf_counter."""
        in_sync = self._serving_state(client)
        if in_sync is None:
            return {}
        gone: list[str] = []
        window_ms = 0
        for run in runs:
            answer = client.find_block_response(self.model, run.first_hash, run.lora_name)
            if any(loc.retention_handle == run.handle for loc in answer.locations):
                continue
            if not answer.read_window_ms:
                raise KvloopError(
                    "the directory does not say its read window (kvloopd older than the connector)"
                )
            gone.append(run.handle)
            window_ms = max(window_ms, answer.read_window_ms)
        if not gone or self._serving_state(client) != in_sync:
            return {}  # re-registered or resynced meanwhile: the answers may predate its state
        free_at = time.perf_counter() + window_ms / 1000 + self.read_margin_s
        return dict.fromkeys(gone, free_at)

    def _serving_state(self, client: DirectoryClient) -> tuple[int, int] | None:
        """This decode's (epoch, resyncs) while the directory serves it in sync; None otherwise."""
        for worker in client.list_workers(self.model):
            if worker.registration.worker_id == self.worker_id:
                if worker.lease_state != pb.LEASE_STATE_ACTIVE:
                    return None
                return worker.registration.epoch, worker.resyncs
        return None

    def _run(self) -> None:
        waiting: list[tuple[GivenUp, float]] = []
        with TracedDirectoryClient(self.daemon, timeout=2.0) as client:
            while not self._stop.is_set():
                try:
                    waiting.append(self._asked.get(timeout=self.poll_s if waiting else 1.0))
                except queue.Empty:
                    pass
                waiting += _drain(self._asked)
                if not waiting:
                    continue
                try:
                    with not_sampled():
                        confirmed = self.check_all(client, [run for run, _ in waiting])
                except KvloopError as e:
                    tm.log.debug("kvloop.release_confirm_failed", runs=len(waiting), error=str(e))
                    confirmed = {}
                still: list[tuple[GivenUp, float]] = []
                for run, since in waiting:
                    free_at = confirmed.get(run.handle)
                    if free_at is not None:
                        self._done.put(Confirmed(run.handle, free_at))
                    elif time.perf_counter() - since > self.give_up_after_s:
                        tm.log.warning(
                            "kvloop.release_unconfirmed",
                            handle=run.handle,
                            detail="the directory was not seen to drop the run: it keeps its lease",
                        )
                        self._done.put(Confirmed(run.handle, None))
                    else:
                        still.append((run, since))
                waiting = still


def _drain(q: queue.SimpleQueue) -> list:
    """Everything ``q`` holds now, without waiting."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
