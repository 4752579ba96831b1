"""Metrics and tracing around any DirectoryStore backend (the backends themselves carry neither).

Every call is timed into ``kvloop_store_call_seconds{backend, op}`` but ``model_spec`` (a read from
memory on both backends) and, on an in-process store whose requests are not traced, ``lookup``: there
it is most of the Lookup that ``kvloop_lookup_latency_seconds`` times already, and timing it again cost
~7% of the handler cold. The calls a request waits on
(lookup, claims, find, registration) also get a span ``kvloop.store.<op>`` with the attribute
``kvloop.store.backend``, when the request they serve is itself recorded (a span whose parent is not
sampled would be dropped anyway, and starting one costs more than an in-memory lookup's probe).
Ingest (apply, heartbeat) is timed but not traced: one span per event batch would cost more than
the batch on the in-memory store.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

from opentelemetry import trace

from kvloop.daemon.histogram import LoopHistogram
from kvloop.daemon.index.model import Change, Event, Location, Namespace, PrefixMatch, WorkerSpec, WorkerView
from kvloop.daemon.index.store import Applied, DirectoryStore, IndexConfig, StoreCounts

STORE_CALL = LoopHistogram(
    "kvloop_store_call_seconds",
    "Time of one directory-store call, by backend and operation",
    ["backend", "op"],
    buckets=(5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 250e-3),
)

tracer = trace.get_tracer("kvloop.daemon.store")
_UNTRACED: AbstractContextManager[trace.Span] = nullcontext(trace.INVALID_SPAN)


class InstrumentedStore:
    """A DirectoryStore that times (and for request-path calls traces) every call of ``inner``."""

    def __init__(self, inner: DirectoryStore, *, traced: bool = True) -> None:
        self.inner = inner
        self.traced = traced  # False: this process exports no spans, so none is ever started
        self.name = inner.name
        self.config: IndexConfig = inner.config
        self.clock: Callable[[], float] = inner.clock  # the backend's own: read on every request
        # Every Lookup and Route asks it first, and both backends answer from memory (Redis keeps a
        # model's spec for a second): passed through untimed, a coroutine and a histogram fewer.
        self.model_spec: Callable[[str], Awaitable[WorkerSpec | None]] = inner.model_spec
        self.in_process = inner.in_process
        self.buckets: int = getattr(inner, "buckets", 1)  # a sharded store's (see store.entry_bound)
        if inner.in_process and not traced:  # no span to start and no I/O to time
            self.lookup = inner.lookup  # type: ignore[method-assign]
        self._timers = {
            op: STORE_CALL.labels(inner.name, op)
            for op in (
                "register",
                "disconnect",
                "heartbeat",
                "last_sequence",
                "worker_spec",
                "mark_resyncing",
                "set_draining",
                "set_unverified",
                "workers",
                "models",
                "reap",
                "apply",
                "begin_snapshot",
                "end_snapshot",
                "lookup",
                "release_claim",
                "stored_prefixes",
                "find",
                "counts",
            )
        }
        self._attributes = {"kvloop.store.backend": inner.name}

    def _span(self, op: str) -> AbstractContextManager[trace.Span]:
        if not self.traced or not trace.get_current_span().is_recording():
            return _UNTRACED
        return tracer.start_as_current_span(f"kvloop.store.{op}", attributes=self._attributes)

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    async def close(self) -> None:
        await self.inner.close()

    # ---- worker registry ---------------------------------------------------------------------

    async def register(self, spec: WorkerSpec, last_sequence: int, now: float) -> tuple[int, bool]:
        with self._span("register"):
            with self._timers["register"].time():
                return await self.inner.register(spec, last_sequence, now)

    async def disconnect(self, worker_id: str, epoch: int, now: float) -> None:
        with self._timers["disconnect"].time():
            await self.inner.disconnect(worker_id, epoch, now)

    async def heartbeat(self, worker_id: str, now: float) -> None:
        with self._timers["heartbeat"].time():
            await self.inner.heartbeat(worker_id, now)

    async def last_sequence(self, worker_id: str) -> int:
        with self._timers["last_sequence"].time():
            return await self.inner.last_sequence(worker_id)

    async def worker_spec(self, worker_id: str) -> WorkerSpec | None:
        with self._timers["worker_spec"].time():
            return await self.inner.worker_spec(worker_id)

    async def mark_resyncing(self, worker_id: str) -> None:
        with self._timers["mark_resyncing"].time():
            await self.inner.mark_resyncing(worker_id)

    async def set_draining(self, worker_id: str) -> bool:
        with self._span("set_draining"):
            with self._timers["set_draining"].time():
                return await self.inner.set_draining(worker_id)

    async def set_unverified(self, worker_id: str) -> bool:
        with self._span("set_unverified"):
            with self._timers["set_unverified"].time():
                return await self.inner.set_unverified(worker_id)

    async def workers(self, now: float, model: str = "") -> list[WorkerView]:
        with self._timers["workers"].time():
            return await self.inner.workers(now, model)

    async def models(self) -> list[str]:
        with self._timers["models"].time():
            return await self.inner.models()

    async def reap(self, now: float) -> list[Change]:
        with self._timers["reap"].time():
            return await self.inner.reap(now)

    # ---- block index -------------------------------------------------------------------------

    async def apply(
        self, worker_id: str, epoch: int, sequence: int, events: Sequence[Event], now: float
    ) -> Applied:
        with self._timers["apply"].time():
            return await self.inner.apply(worker_id, epoch, sequence, events, now)

    async def begin_snapshot(self, worker_id: str, now: float) -> None:
        with self._timers["begin_snapshot"].time():
            await self.inner.begin_snapshot(worker_id, now)

    async def end_snapshot(self, worker_id: str, sequence: int, now: float) -> None:
        with self._timers["end_snapshot"].time():
            await self.inner.end_snapshot(worker_id, sequence, now)

    async def lookup(
        self,
        namespace: Namespace,
        hashes: Sequence[bytes],
        local_blocks: int,
        requester: str,
        now: float,
        claim: bool,
        *,
        margin_s: float = 0.0,
        accept: Callable[[WorkerSpec], bool] | None = None,
    ) -> PrefixMatch:
        started = time.perf_counter()
        try:
            if not self.traced or not trace.get_current_span().is_recording():
                return await self.inner.lookup(
                    namespace, hashes, local_blocks, requester, now, claim, margin_s=margin_s, accept=accept
                )
            with tracer.start_as_current_span("kvloop.store.lookup", attributes=self._attributes) as span:
                match = await self.inner.lookup(
                    namespace, hashes, local_blocks, requester, now, claim, margin_s=margin_s, accept=accept
                )
                span.set_attributes(
                    {
                        "kvloop.store.claim": claim,
                        "kvloop.store.prompt_blocks": len(hashes),
                        "kvloop.store.matched_blocks": match.best.matched_blocks if match.best else 0,
                    }
                )
                return match
        finally:
            self._timers["lookup"].observe(time.perf_counter() - started)

    async def stored_prefixes(
        self, namespace: Namespace, hashes: Sequence[bytes], workers: Sequence[str], now: float
    ) -> dict[str, int]:
        with self._span("stored_prefixes"):
            with self._timers["stored_prefixes"].time():
                return await self.inner.stored_prefixes(namespace, hashes, workers, now)

    async def release_claim(self, namespace: Namespace, holder: str, handle: str, requester: str) -> bool:
        with self._span("release_claim"):
            with self._timers["release_claim"].time():
                return await self.inner.release_claim(namespace, holder, handle, requester)

    async def find(self, namespace: Namespace, block_hash: bytes, now: float) -> list[Location]:
        with self._span("find"):
            with self._timers["find"].time():
                return await self.inner.find(namespace, block_hash, now)

    async def counts(self) -> StoreCounts:
        with self._timers["counts"].time():
            return await self.inner.counts()
