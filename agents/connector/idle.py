"""Let vLLM's engine loop sleep while the engine only holds retained runs.

This is kvloop's one override of vLLM's engine core (``EngineCoreProc``) and scheduler; like the
NIXL overrides in :mod:`.worker` it mirrors vLLM 0.32.0 and refuses another version at import.

Why a decode holding retained runs spins (vLLM 0.32.0):

* The engine-core loop (``EngineCoreProc.run_busy_loop``, vllm/v1/engine/core.py:1547) blocks on its
  input queue only while ``has_work()`` is False (``_process_input_queue``, core.py:1573-1590), and
  ``has_work()`` is ``scheduler.has_requests()`` (core.py:1534-1540).
* ``Scheduler.has_requests()`` (vllm/v1/core/sched/scheduler.py:2823) includes
  ``has_finished_requests()`` (scheduler.py:2813-2821): a finished request whose blocks a KV connector
  still holds stays in ``scheduler.requests`` (``_free_request`` with ``delay_free_blocks``,
  scheduler.py:2715-2743) and counts as work until the worker reports it in ``finished_sending``.
  The NIXL connector delays the free of every finished request it retains for a reverse pull
  (``NixlPullConnectorScheduler.request_finished``, nixl/pull_scheduler.py:247-265), and its worker
  only learns of a READ's notice or a lease's end when the engine steps (``get_transfer_results``
  polls NIXL notifications and reaps expired leases, nixl/base_worker.py:2853-3040).
* So while the decode holds any run, for the whole lease (``decoder_kv_blocks_ttl``, 480 s by
  default), the loop steps an empty schedule, sleeps 1 ms (core.py:1616) and steps again, and every
  step sends its scheduler stats to the API server (``update_from_output``, scheduler.py:2416-2430),
  whose output handler wakes for each of them.

What a retained multi-reader run actually needs from the engine: nothing while its lease runs. A
peer's READ is one-sided (NIXL's progress thread serves it, no engine step involved) and its
notice only counts a read (kvloop keeps the run until the lease ends, :mod:`.worker`); the
notices wait in NIXL's queue and are counted at the next step. One step is needed at the lease's
end, where the worker reaps the run (``_reap_expired_send_leases``) and the scheduler frees it.

The override, installed on the engine-core process's loop when it starts:

* the scheduler's ``has_requests`` answers False while every request it still holds is a finished
  run the connector parks (:meth:`KvloopConnectorScheduler.parked_until`: multi-reader runs whose
  lease has not ended) and nothing else is pending; the loop then blocks on its input queue as it
  does with no request at all (and a shutdown no longer waits for the leases);
* a timer thread puts vLLM's own ``WAKEUP`` message (what vLLM's shutdown signal uses to wake an
  idle loop, core.py:1444-1449) into the input queue at the earliest lease end; the run is due
  then, so the loop steps until the worker has reaped it (a step or two: the worker's lease clock
  is rebased a few microseconds later) and sleeps again.

Single-use runs (``kvloop_sharing: single``, vLLM's built-in reverse mode) are not parked: their
release follows the READ's notice, which only an engine step picks up, so the loop keeps stepping
while one is held (vLLM's behaviour). Data-parallel engine cores (their own busy loop, which polls
by design) and in-process engines (``vllm.LLM`` without multiprocessing: no busy loop) are left as
they are. ``kvloop_idle_wait: false`` turns the override off.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.worker import check_vllm_version

check_vllm_version()

ParkedUntil = Callable[[str], "float | None"]


class LeaseTimer:
    """Calls ``wake`` once at the time last given to :meth:`wake_at` (``perf_counter`` clock)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._cond = threading.Condition()
        self._at: float | None = None
        self._thread: threading.Thread | None = None

    def wake_at(self, when: float) -> None:
        with self._cond:
            if self._at != when:
                self._at = when
                self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvloop-lease-timer", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._at is None:
                    self._cond.wait()
                    continue
                delay = self._at - time.perf_counter()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                self._at = None
                tm.IDLE_WAKEUPS.inc()
                self._wake()


def earliest_lease_end(scheduler: Any, parked_until: ParkedUntil, now: float) -> float | None:
    """When every request ``scheduler`` holds is a parked run and nothing else is pending: the
    earliest end of their leases. None when the engine has something to step for."""
    if scheduler.has_unfinished_requests() or scheduler.finished_req_ids:
        return None
    for connector in (scheduler.connector, getattr(scheduler, "ec_connector", None)):
        if connector is not None and connector.has_pending_push_work():
            return None
    earliest: float | None = None
    for request_id, request in scheduler.requests.items():
        if not request.is_finished():
            return None
        until = parked_until(request_id)
        if until is None or until <= now:
            return None
        earliest = until if earliest is None else min(earliest, until)
    return earliest


def attach(engine: Any) -> bool:
    """Let ``engine`` (an ``EngineCoreProc`` about to run its loop) block while it only holds
    parked runs. False (nothing changed) unless its KV connector is kvloop's with idle waits on."""
    if not getattr(engine, "process_input_queue_block", False):
        return False  # a loop that polls by design (data-parallel engine cores)
    scheduler = engine.scheduler
    connector = scheduler.get_kv_connector() if hasattr(scheduler, "get_kv_connector") else None
    half = getattr(connector, "connector_scheduler", None)
    parked_until: ParkedUntil | None = getattr(half, "parked_until", None)
    if parked_until is None or not getattr(getattr(half, "cfg", None), "idle_wait", False):
        return False
    from vllm.v1.engine import EngineCoreRequestType

    queue = engine.input_queue
    timer = LeaseTimer(lambda: queue.put_nowait((EngineCoreRequestType.WAKEUP, None)))
    vllm_has_requests = scheduler.has_requests

    def has_requests() -> bool:
        if not vllm_has_requests():
            return False
        until = earliest_lease_end(scheduler, parked_until, time.perf_counter())
        if until is None:
            return True
        timer.wake_at(until)
        return False

    scheduler.has_requests = has_requests  # this engine's scheduler only
    tm.log.info("kvloop.idle_wait", detail="the engine loop sleeps while it only holds retained runs")
    return True


def install() -> None:
    """Hook ``EngineCoreProc.run_busy_loop`` (once per process) so that an engine core whose KV
    connector is kvloop's gets :func:`attach`-ed before its loop starts. The connector's scheduler
    half calls this while vLLM builds the engine core, i.e. before the loop runs."""
    from vllm.v1.engine.core import EngineCoreProc

    run_busy_loop = EngineCoreProc.run_busy_loop
    if getattr(run_busy_loop, "_kvloop_idle", False):
        return

    @functools.wraps(run_busy_loop)
    def run_busy_loop_with_idle_wait(self: Any) -> Any:
        attach(self)
        return run_busy_loop(self)

    run_busy_loop_with_idle_wait._kvloop_idle = True  # type: ignore[attr-defined]
    EngineCoreProc.run_busy_loop = run_busy_loop_with_idle_wait
