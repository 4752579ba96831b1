"""The worker registry of both Redis stores: each model's workers (their specs, fences, leases and
liveness) in the model's own slot (``model_base``), changed only by the functions of
``directory.lua``. A cluster spreads a model's blocks over buckets but never its registry, so a
worker's fence stays one key, on one server or many (a call per event batch, in the model's slot:
a few percent of that node's work in the replay, against the buckets' ingest).

This process keeps caches beside it: a worker's spec under one epoch never changes, a worker id keeps
its model, and a model's block layout holds while any of its workers is registered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from redis.exceptions import RedisError

from kvloop.daemon.index.model import LeaseState, PrefixMatch, WorkerSpec, WorkerView
from kvloop.daemon.index.redis_wire import (
    MODELS,
    RefusedHolder,
    holding,
    model_base,
    refused_holder,
    spec_from_json,
    spec_json,
    text,
)
from kvloop.daemon.index.store import DirectoryError, IndexConfig

log = structlog.get_logger("kvloop.daemon")

# A model's spec (its block layout), read on every Lookup: used as is up to MODEL_SPEC_FRESH_S old,
# used while a refresh runs beside the Lookup up to MODEL_SPEC_STALE_S old, fetched first beyond.
MODEL_SPEC_FRESH_S = 1.0
MODEL_SPEC_STALE_S = 30.0


class SlotRegistry:
    """Registration, leases and specs of the workers of every model in one Redis store.

    ``fcall`` calls a function of the library (the store's own way: a cluster bounds its calls in
    flight); plain reads go through ``client``."""

    def __init__(self, client: Any, config: IndexConfig, fcall: Callable[..., Awaitable[Any]]) -> None:
        self.config = config
        self._r = client
        self._fcall = fcall
        self.lease_ms = str(max(1, int(config.lease_s * 1000)))
        self._specs: dict[tuple[str, str], WorkerSpec] = {}  # (worker, epoch) -> spec
        self._model_specs: dict[str, tuple[float, WorkerSpec]] = {}  # model -> (fetched at, spec)
        self._spec_refreshes: dict[str, asyncio.Task] = {}  # model -> its refresh in the background
        self._model_of: dict[str, str] = {}  # worker -> model (a worker id keeps its model)

    async def close(self) -> None:
        refreshes = list(self._spec_refreshes.values())
        for refresh in refreshes:
            refresh.cancel()
        await asyncio.gather(*refreshes, return_exceptions=True)

    def forget(self) -> None:
        """Drop every cache (the store's data was flushed)."""
        self._model_specs.clear()
        self._specs.clear()
        self._model_of.clear()

    def forget_model(self, model: str) -> None:
        """A worker of ``model`` was dropped: its layout may be the model's no more."""
        self._model_specs.pop(model, None)

    def model_of(self, worker_id: str) -> str | None:
        return self._model_of.get(worker_id)

    async def bases(self) -> dict[str, str]:
        """Every model ever registered -> its key base."""
        return {text(m): text(b) for m, b in (await self._r.hgetall(MODELS)).items()}

    async def _worker_base(self, worker_id: str) -> str | None:
        model = self._model_of.get(worker_id)
        if model is None:
            spec = await self.worker_spec(worker_id)
            return model_base(spec.model) if spec is not None else None
        return model_base(model)

    async def _spec_of(self, base: str, worker_id: str, epoch: str) -> WorkerSpec:
        """The spec ``worker_id`` registered under ``epoch``."""
        spec = self._specs.get((worker_id, epoch))
        if spec is None:
            raw = await self._r.hget(f"{base}w:{worker_id}", "spec")
            if raw is None:
                raise DirectoryError("NOT_FOUND", f"worker {worker_id!r} is not registered")
            spec = self._specs[(worker_id, epoch)] = spec_from_json(raw)
        return spec

    async def spec_at(self, worker_id: str, epoch: int) -> WorkerSpec | None:
        """The spec a batch of ``worker_id`` under ``epoch`` is applied with; None when unknown."""
        return self._specs.get((worker_id, str(epoch))) or await self.worker_spec(worker_id)

    # ---- registration ------------------------------------------------------------------------

    async def register_call(self, spec: WorkerSpec, last_sequence: int, now: float, *more: Any) -> list[Any]:
        """kvl_register's reply for ``spec`` (``more``: the store's own arguments to it); the
        registration is not taken until :meth:`registered` read the reply."""
        self._model_specs.pop(spec.model, None)  # this replica's cache follows its own writes at once
        base = model_base(spec.model)
        layout = f"{spec.block_size}|{spec.hash_algorithm}|{spec.hash_length}"
        await self._r.hset(MODELS, spec.model, base)
        args = [
            base,
            spec.worker_id,
            str(spec.epoch),
            last_sequence,
            repr(now),
            repr(self.config.lease_s),
            self.lease_ms,
            spec_json(spec),
            layout,
            *more,
        ]
        return await self._fcall("kvl_register", [f"{base}w:{spec.worker_id}"], *args)

    def registered(self, spec: WorkerSpec, reply: list[Any]) -> tuple[int, bool]:
        """(last applied sequence, resync required) from kvl_register's reply, or the refusal."""
        status = text(reply[0])
        if status == "incompatible":
            other, theirs = text(reply[1]), text(reply[2]).split("|")
            mine = (spec.block_size, spec.hash_algorithm, spec.hash_length)
            raise DirectoryError(
                "FAILED_PRECONDITION",
                f"model {spec.model!r} is served with block_size={theirs[0]}, hash_algorithm="
                f"{theirs[1]!r}, hash_length={theirs[2]} (worker {other!r}); worker "
                f"{spec.worker_id!r} registered block_size={mine[0]}, hash_algorithm={mine[1]!r}, "
                f"hash_length={mine[2]}: their block hashes would never match",
            )
        if status == "busy":
            raise DirectoryError(
                "ALREADY_EXISTS",
                f"worker {spec.worker_id!r} is connected (epoch {text(reply[1])}, last seen "
                f"{float(reply[2]):.1f}s ago); another agent may take over only after its lease "
                f"({self.config.lease_s:.0f}s) lapses",
            )
        self._specs[(spec.worker_id, str(spec.epoch))] = spec
        self._model_of[spec.worker_id] = spec.model
        return int(reply[1]), bool(reply[2])

    async def disconnect(self, worker_id: str, epoch: int, now: float) -> None:
        base = await self._worker_base(worker_id)
        if base is not None:
            await self._fcall(
                "kvl_disconnect", [f"{base}w:{worker_id}"], base, worker_id, str(epoch), repr(now)
            )

    async def heartbeat(self, worker_id: str, now: float) -> None:
        base = await self._worker_base(worker_id)
        if base is not None:
            await self._fcall(
                "kvl_heartbeat", [f"{base}w:{worker_id}"], base, worker_id, repr(now), self.lease_ms
            )

    async def mark_resyncing(self, worker_id: str) -> None:
        await self._set_state(worker_id, LeaseState.RESYNCING)

    async def set_draining(self, worker_id: str) -> bool:
        return await self._set_state(worker_id, LeaseState.DRAINING)

    async def set_unverified(self, worker_id: str) -> bool:
        base = await self._worker_base(worker_id)
        if base is None:
            return False
        return bool(await self._fcall("kvl_set_unverified", [f"{base}w:{worker_id}"]))

    async def _set_state(self, worker_id: str, state: LeaseState) -> bool:
        base = await self._worker_base(worker_id)
        if base is None:
            return False
        return bool(await self._fcall("kvl_set_state", [f"{base}w:{worker_id}"], int(state)))

    async def snapshot(self, worker_id: str, step: str, now: float, sequence: int = 0, *more: Any) -> Any:
        """kvl_snapshot's reply: a worker's resync snapshot begins or ends (``more``: the store's own
        arguments to it)."""
        base = await self._worker_base(worker_id)
        if base is None:
            raise KeyError(worker_id)
        return await self._fcall(
            "kvl_snapshot", [f"{base}w:{worker_id}"], base, worker_id, step, repr(now), sequence, *more
        )

    # ---- reads -------------------------------------------------------------------------------

    async def last_sequence(self, worker_id: str) -> int:
        base = await self._worker_base(worker_id)
        raw = await self._r.hget(f"{base}w:{worker_id}", "seq") if base else None
        return int(raw or 0)

    async def worker_spec(self, worker_id: str) -> WorkerSpec | None:
        model = self._model_of.get(worker_id)
        bases = [model_base(model)] if model is not None else list((await self.bases()).values())
        for base in bases:
            raw = await self._r.hget(f"{base}w:{worker_id}", "spec")
            if raw is not None:
                spec = spec_from_json(raw)
                self._model_of[worker_id] = spec.model
                return spec
        return None

    async def model_spec(self, model: str) -> WorkerSpec | None:
        # Asked on every Lookup; a model's block layout holds while any of its workers is registered
        # (register refuses another), so a recent answer is as good as a fresh one. An older one is
        # refreshed beside the Lookup, not before it: a model whose Lookups came a second or more
        # apart paid two round trips through redis-py's client on every one.
        cached = self._model_specs.get(model)
        if cached is not None:
            age = time.monotonic() - cached[0]
            if age < MODEL_SPEC_FRESH_S:
                return cached[1]
            if age < MODEL_SPEC_STALE_S:
                if model not in self._spec_refreshes:
                    self._spec_refreshes[model] = asyncio.create_task(self._refresh_model_spec(model))
                return cached[1]
        return await self._fetch_model_spec(model)

    async def _refresh_model_spec(self, model: str) -> None:
        try:
            await self._fetch_model_spec(model)
        except (RedisError, OSError) as exc:  # the cached spec stays; the next Lookup tries again
            log.debug("model spec refresh failed", model=model, error=str(exc))
        finally:
            self._spec_refreshes.pop(model, None)

    async def _fetch_model_spec(self, model: str) -> WorkerSpec | None:
        now = time.monotonic()
        base = model_base(model)
        worker: Any = await self._r.srandmember(f"{base}workers")
        raw = await self._r.hget(f"{base}w:{text(worker)}", "spec") if worker is not None else None
        if raw is None:
            self._model_specs.pop(model, None)
            return None
        spec = spec_from_json(raw)
        self._model_specs[model] = (now, spec)
        return spec

    async def workers(self, now: float, model: str = "") -> list[WorkerView]:
        """The workers as their registry holds them (block counts: the worker's hash's own)."""
        bases = await self.bases()
        views = []
        for name, base in sorted(bases.items()):
            if model and name != model:
                continue
            ids = sorted(text(w) for w in await self._r.smembers(f"{base}workers"))
            async with self._r.pipeline(transaction=False) as pipe:
                for w in ids:
                    pipe.hgetall(f"{base}w:{w}")
                    pipe.exists(f"{base}alive:{w}")
                    pipe.hlen(f"{base}wr:{w}")
                replies = await pipe.execute()
            for i in range(len(ids)):
                fields = {text(k): v for k, v in replies[3 * i].items()}
                if not fields:
                    continue
                connected = bool(replies[3 * i + 1])
                seen = float(fields["seen"])
                state = LeaseState(int(fields["state"]))
                if state == LeaseState.ACTIVE and not (connected and now - seen <= self.config.lease_s):
                    state = LeaseState.EXPIRED
                views.append(
                    WorkerView(
                        spec=spec_from_json(fields["spec"]),
                        state=state,
                        connected=connected,
                        last_applied_sequence=int(fields["seq"]),
                        stored_blocks=int(fields["sblocks"]),
                        retained_blocks=int(fields["rblocks"]),
                        retained_runs=int(replies[3 * i + 2]),
                        last_seen_s_ago=max(0.0, now - seen),
                        events_ingested=int(fields["events"]),
                        resyncs=int(fields["resyncs"]),
                    )
                )
        return views

    async def models(self) -> list[str]:
        bases = await self.bases()
        return sorted([m for m, base in bases.items() if await self._r.scard(f"{base}workers")])

    # ---- answers -----------------------------------------------------------------------------

    async def answer(
        self,
        base: str,
        reply: list,
        accept: Callable[[WorkerSpec], bool] | None,
        current: Callable[[str, str], bool] | None = None,
    ) -> PrefixMatch | RefusedHolder:
        """A lookup function's reply as a PrefixMatch; or, when its first holder is not to be handed
        out (``accept``, the caller's layout check, refuses it; or ``current(worker, epoch)`` says the
        run's epoch is not its worker's), that holder, for the caller to give its claim back and
        exclude it before asking again."""
        if text(reply[0]) == "none":
            return PrefixMatch(None, [], text(reply[1]) or None)
        matched = int(reply[1])
        holdings = []
        for entry in reply[2:]:
            worker, epoch = text(entry[0]), text(entry[1])
            if current is not None and not current(worker, epoch):
                continue
            spec = self._specs.get((worker, epoch)) or await self._spec_of(base, worker, epoch)
            holdings.append(holding(spec, matched, entry))
        first = reply[2]
        best = holdings[0] if holdings and holdings[0].worker.worker_id == text(first[0]) else None
        if best is not None and (accept is None or accept(best.worker)):
            return PrefixMatch(best, [h for h in holdings[1:] if accept is None or accept(h.worker)])
        return refused_holder(first)
